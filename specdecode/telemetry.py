"""Tracing, structured logs and OTLP metrics.

Two halves, kept apart on purpose:

* What library code uses (`tracer`, `child_span`, `step_span`, `trace_metadata`,
  `extract_context`, `RequestSpan`, the log filter and formatters): the OpenTelemetry *API*
  only. With no SDK configured every span is a no-op and every helper returns at once.
* What entry points use (`configure`): builds the SDK tracer provider and the
  Prometheus->OTLP metrics bridge from the standard `OTEL_*` environment variables. The SDK
  and exporters are imported inside it and nowhere else.

Sampling rule for internal, client and continued server spans: they are created only under
a *sampled* parent. An unsampled parent (a request the sampler dropped, or a step the
step-span sampling skips) therefore silences everything below it, in this process and,
through the unsampled W3C `traceparent` it propagates, in the proposer and scorer too.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import (INVALID_SPAN, Link, NonRecordingSpan, SpanContext, SpanKind,
                                 Status, StatusCode, TraceFlags)

log = logging.getLogger(__name__)

# Bounds on what one step span carries about the requests it served.
MAX_STEP_LINKS = 32
MAX_STEP_REQUEST_IDS = 16

# -- tracers -------------------------------------------------------------------------------

_tracers: dict[str, tuple[Any, trace.Tracer]] = {}


def tracer(name: str) -> trace.Tracer:
    """The global provider's tracer for `name`, re-fetched when the provider changes (so a
    provider configured after import, or swapped by a test, is always the one used)."""
    provider = trace.get_tracer_provider()
    cached = _tracers.get(name)
    if cached is None or cached[0] is not provider:
        cached = (provider, provider.get_tracer(name))
        _tracers[name] = cached
    return cached[1]


def enabled() -> bool:
    """Whether an SDK (or any real) tracer provider is installed."""
    return not isinstance(trace.get_tracer_provider(),
                          (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def _sampled(span_context: SpanContext) -> bool:
    return span_context.is_valid and span_context.trace_flags.sampled


class child_span:
    """A span under the current one, only if the current one is sampled; else a no-op span.
    Exceptions are recorded on the span and set its status to ERROR. (A plain class rather
    than a generator context manager: it runs a dozen times per step.)"""

    __slots__ = ("name", "attributes", "kind", "tracer_name", "span", "token")

    def __init__(self, name: str, attributes: Mapping[str, Any] | None = None, *,
                 kind: SpanKind = SpanKind.INTERNAL, tracer_name: str = "specdecode"):
        self.name, self.attributes = name, attributes
        self.kind, self.tracer_name = kind, tracer_name
        self.span: trace.Span = INVALID_SPAN
        self.token = None

    def __enter__(self) -> trace.Span:
        if not _sampled(trace.get_current_span().get_span_context()):
            return INVALID_SPAN
        self.span = tracer(self.tracer_name).start_span(self.name, kind=self.kind,
                                                         attributes=self.attributes)
        self.token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.token is None:
            return False
        otel_context.detach(self.token)
        self.token = None
        if exc is not None and self.span.is_recording():
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, f"{exc_type.__name__}: {exc}"))
        self.span.end()
        return False


def set_attributes(span: trace.Span, attributes: Mapping[str, Any]) -> None:
    if span.is_recording():
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


@contextlib.contextmanager
def in_context(ctx: otel_context.Context | None) -> Iterator[None]:
    """Make `ctx` current for the block (nothing when None): e.g. so that a log line written
    on another thread carries a request's trace id."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current context as gRPC metadata (W3C traceparent/tracestate, baggage)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


_PROPAGATED = frozenset(("traceparent", "tracestate", "baggage"))


def extract_context(metadata) -> otel_context.Context | None:
    """The trace context carried by incoming gRPC metadata, or None if there is none."""
    carrier = {k: v for k, v in (metadata or ()) if k in _PROPAGATED}
    return propagate.extract(carrier) if carrier else None


def span_context_of(ctx: otel_context.Context | None) -> SpanContext:
    return trace.get_current_span(ctx).get_span_context() if ctx is not None \
        else INVALID_SPAN.get_span_context()


# -- the request span (orchestrator) -------------------------------------------------------

class RequestSpan:
    """The span of one Generate call. Its context travels with the engine Request to the
    engine thread (contextvars do not cross threads), where step spans attach to it."""

    def __init__(self, name: str, attributes: Mapping[str, Any], start_time_ns: int | None = None,
                 tracer_name: str = "specdecode.orchestrator"):
        self.span = tracer(tracer_name).start_span(name, attributes=attributes,
                                                   start_time=start_time_ns)
        valid = self.span.get_span_context().is_valid
        self.context = trace.set_span_in_context(self.span) if valid else None
        self._ended = False

    def end(self, attributes: Mapping[str, Any] | None = None,
            error: BaseException | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        if attributes:
            set_attributes(self.span, attributes)
        if error is not None:
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self.span.end()


# -- the step span (orchestrator engine thread) ----------------------------------------------

@contextlib.contextmanager
def step_span(name: str, requests: Sequence[tuple[str, otel_context.Context | None]],
              traced: bool, attributes: Mapping[str, Any] | None = None,
              tracer_name: str = "specdecode.orchestrator") -> Iterator[trace.Span]:
    """The span of one engine step, which serves several requests at once.

    Its parent is the oldest participating request whose span is sampled; every other
    sampled participant gets a span Link (at most MAX_STEP_LINKS), and the first
    MAX_STEP_REQUEST_IDS request ids are recorded in `specdecode.request_ids`. With a single
    request in flight every step span is therefore inside that request's trace.

    When the step is not traced (step-span sampling) or no participant is sampled, the
    step runs under a non-recording, *unsampled* span of the oldest request's trace: no
    child span is made here, and the services, receiving an unsampled traceparent, make
    none either. With no participant carrying a context (tracing off) it is a no-op.
    """
    parents = [(rid, ctx, span_context_of(ctx)) for rid, ctx in requests if ctx is not None]
    parents = [p for p in parents if p[2].is_valid]
    if not parents:
        yield INVALID_SPAN
        return
    sampled = [p for p in parents if p[2].trace_flags.sampled]
    if not traced or not sampled:
        sc = (sampled or parents)[0][2]
        quiet = NonRecordingSpan(SpanContext(sc.trace_id, sc.span_id, is_remote=False,
                                             trace_flags=TraceFlags(TraceFlags.DEFAULT),
                                             trace_state=sc.trace_state))
        token = otel_context.attach(trace.set_span_in_context(quiet))
        try:
            yield quiet
        finally:
            otel_context.detach(token)
        return
    (parent_id, parent_ctx, _), others = sampled[0], sampled[1:]
    links = [Link(sc, {"specdecode.request_id": rid}) for rid, _, sc in others[:MAX_STEP_LINKS]]
    attrs = {"specdecode.request_ids": [rid for rid, _, _ in parents[:MAX_STEP_REQUEST_IDS]],
             "specdecode.parent_request_id": parent_id, **(attributes or {})}
    with tracer(tracer_name).start_as_current_span(name, context=parent_ctx, links=links,
                                                   attributes=attrs) as span:
        yield span


def parse_trace_steps(value: str | int) -> int:
    """--trace-steps: "all" -> 1 (every step), "none" -> 0 (request spans only), N -> every
    Nth step. ValueError otherwise."""
    text = str(value).strip().lower()
    if text == "all":
        return 1
    if text == "none":
        return 0
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"trace steps: must be 'all', 'none' or a step interval >= 0, "
                         f"got {value!r}")
    return n


# -- logs ----------------------------------------------------------------------------------

class TraceContextFilter(logging.Filter):
    """Adds trace_id and span_id (hex, "" outside a span) to every record. Put it on the
    handler: it runs in the thread that logs, where the current span is the right one."""

    def filter(self, record: logging.LogRecord) -> bool:
        sc = trace.get_current_span().get_span_context()
        if sc.is_valid:
            record.trace_id = format(sc.trace_id, "032x")
            record.span_id = format(sc.span_id, "016x")
        else:
            record.trace_id = record.span_id = ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, service,
    trace_id and span_id (when inside a span), exception (the formatted traceback), and
    the entries of a `fields` dict passed as `extra={"fields": {...}}`."""

    def __init__(self, service: str = ""):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if self.service:
            out["service"] = self.service
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update({k: v for k, v in fields.items() if k not in out})
        if getattr(record, "trace_id", ""):
            out["trace_id"], out["span_id"] = record.trace_id, record.span_id
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        for key, value in out.items():  # strict JSON: no NaN/Infinity literals
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = str(value)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """The plain format, with trace_id=... span_id=... appended inside a span."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if getattr(record, "trace_id", ""):
            line += f" trace_id={record.trace_id} span_id={record.span_id}"
        return line


def configure_logging(service: str, fmt: str = "json", level: int = logging.INFO) -> None:
    """Replace the root logger's handlers with one stderr handler in `fmt` (json | text)."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format: must be json or text, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.addFilter(TraceContextFilter())
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


# -- SDK set-up (entry points only) ----------------------------------------------------------

TRACE_EXPORTERS = ("otlp", "console")


def _env_list(env: Mapping[str, str], name: str) -> list[str] | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    return [n.strip().lower() for n in raw.split(",") if n.strip()]


def _otlp_endpoint_set(env: Mapping[str, str], signal: str) -> bool:
    return bool(env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or
                env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def trace_exporter_names(env: Mapping[str, str], console: bool = False) -> list[str]:
    """Which span exporters to run: OTEL_TRACES_EXPORTER if set (none = off), else otlp when
    an OTLP endpoint is set; plus console on --trace-console. [] = tracing off."""
    if str(env.get("OTEL_SDK_DISABLED", "")).lower() == "true":
        return []
    names = _env_list(env, "OTEL_TRACES_EXPORTER")
    if names is None:
        names = ["otlp"] if _otlp_endpoint_set(env, "TRACES") else []
    if "none" in names:
        names = []
    for n in names:
        if n not in TRACE_EXPORTERS:
            raise ValueError(f"OTEL_TRACES_EXPORTER: {n!r} is not supported here "
                             f"(use {', '.join(TRACE_EXPORTERS)} or none)")
    if console and "console" not in names:
        names.append("console")
    return names


def metrics_exporter_enabled(env: Mapping[str, str]) -> bool:
    """OTLP metrics: OTEL_METRICS_EXPORTER contains otlp, or it is unset and an OTLP endpoint
    is set. Prometheus scraping (/metrics) is independent of this."""
    if str(env.get("OTEL_SDK_DISABLED", "")).lower() == "true":
        return False
    names = _env_list(env, "OTEL_METRICS_EXPORTER")
    if names is None:
        return _otlp_endpoint_set(env, "METRICS")
    return "otlp" in names


def _protocol(env: Mapping[str, str], signal: str) -> str:
    # The spec's default is http/protobuf; the gRPC exporter is the one installed with
    # specdecode (and what the Helm chart configures), so grpc is the default here.
    return (env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or
            env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()


def _otlp_exporter(env: Mapping[str, str], signal: str):
    protocol = _protocol(env, signal)
    kind = {"TRACES": "trace_exporter", "METRICS": "metric_exporter"}[signal]
    cls = {"TRACES": "OTLPSpanExporter", "METRICS": "OTLPMetricExporter"}[signal]
    if protocol == "grpc":
        module = f"opentelemetry.exporter.otlp.proto.grpc.{kind}"
    elif protocol == "http/protobuf":
        module = f"opentelemetry.exporter.otlp.proto.http.{kind}"
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported "
                         "(use grpc or http/protobuf)")
    # Exporters read the rest of OTEL_EXPORTER_OTLP_* (headers, timeout, TLS) themselves;
    # the endpoint is passed so that `env` is the one that counts.
    endpoint = env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    if not endpoint and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
        if protocol == "http/protobuf":  # the base URL: add the signal's path
            path = "/v1/traces" if signal == "TRACES" else "/v1/metrics"
            endpoint = endpoint.rstrip("/") + path
    import importlib
    try:
        exporter_cls = getattr(importlib.import_module(module), cls)
    except ImportError:
        package = "opentelemetry-exporter-otlp-proto-" + ("grpc" if protocol == "grpc" else "http")
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol} needs the Python package "
                         f"{package}; install it or use grpc") from None
    return exporter_cls(endpoint=endpoint) if endpoint else exporter_cls()


def _resource_attributes(env: Mapping[str, str]) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES: key=value pairs, comma-separated, values percent-encoded."""
    from urllib.parse import unquote
    attrs = {}
    for pair in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            attrs[key.strip()] = unquote(value.strip())
    return attrs


def build_resource(role: str, env: Mapping[str, str]):
    """The SDK Resource: OTEL_RESOURCE_ATTRIBUTES, then service.name from OTEL_SERVICE_NAME
    (default specdecode-<role>), and specdecode.role."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    attrs = _resource_attributes(env)
    attrs[SERVICE_NAME] = env.get("OTEL_SERVICE_NAME") or attrs.get(SERVICE_NAME) \
        or f"specdecode-{role}"
    attrs["specdecode.role"] = role
    return Resource.create(attrs)


def build_tracer_provider(role: str, env: Mapping[str, str], console: bool = False):
    """An SDK TracerProvider with the configured exporters, or None when tracing is off.
    The sampler comes from OTEL_TRACES_SAMPLER/_ARG (default parentbased_always_on), the
    batch schedule from OTEL_BSP_*."""
    names = trace_exporter_names(env, console)
    if not names:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter,
                                                SimpleSpanProcessor)
    exporters = {n: (_otlp_exporter(env, "TRACES") if n == "otlp" else None) for n in names}
    provider = TracerProvider(resource=build_resource(role, env), shutdown_on_exit=False)
    for name, exporter in exporters.items():
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(exporter))
        else:
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))
    return provider


class Telemetry:
    """What `configure` set up; `shutdown` flushes and stops it (call it on exit)."""

    def __init__(self, tracer_provider=None, metrics_bridge: PrometheusOtlpBridge | None = None):
        self.tracer_provider = tracer_provider
        self.metrics_bridge = metrics_bridge

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    def shutdown(self) -> None:
        if self.metrics_bridge is not None:
            self.metrics_bridge.shutdown()
            self.metrics_bridge = None
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()  # flushes the batch processor
            self.tracer_provider = None


def configure(role: str, *, console: bool = False, env: Mapping[str, str] | None = None,
              set_global: bool = True) -> Telemetry:
    """Set up tracing and OTLP metrics for one server process from the environment. With
    nothing configured it creates nothing (no provider, no exporter, no thread).
    ValueError on a configuration this build cannot honour."""
    env = os.environ if env is None else env
    provider = build_tracer_provider(role, env, console)
    bridge = None
    if metrics_exporter_enabled(env):
        bridge = PrometheusOtlpBridge(_otlp_exporter(env, "METRICS"), build_resource(role, env),
                                      interval_s=float(env.get("OTEL_METRIC_EXPORT_INTERVAL",
                                                               60000)) / 1000)
    if set_global:
        if provider is not None:
            trace.set_tracer_provider(provider)
        if bridge is not None:
            bridge.start()
    return Telemetry(provider, bridge)


# -- Prometheus -> OTLP metrics --------------------------------------------------------------

def prometheus_to_otlp(registry, start_time_ns: int, prefix: str = "specdecode_") -> list:
    """The registry's `prefix*` metric families as OTLP (SDK) metrics, cumulative: counters
    as monotonic sums (named without _total), gauges as gauges, histograms as explicit-bucket
    histograms. Other families (summaries, info) are skipped."""
    from opentelemetry.sdk.metrics.export import (AggregationTemporality, Gauge, Histogram,
                                                  HistogramDataPoint, Metric, NumberDataPoint,
                                                  Sum)
    now = time.time_ns()
    cumulative = AggregationTemporality.CUMULATIVE
    metrics = []
    for family in registry.collect():
        if not family.name.startswith(prefix):
            continue
        if family.type in ("counter", "gauge"):
            suffix = "_total" if family.type == "counter" else ""
            points = [NumberDataPoint(attributes=dict(s.labels), start_time_unix_nano=start_time_ns,
                                      time_unix_nano=now, value=float(s.value))
                      for s in family.samples if s.name == family.name + suffix]
            if not points:
                continue
            data = (Sum(points, cumulative, is_monotonic=True) if family.type == "counter"
                    else Gauge(points))
        elif family.type == "histogram":
            series: dict[tuple, dict] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                entry = series.setdefault(tuple(sorted(labels.items())),
                                          {"labels": labels, "buckets": [], "sum": 0.0, "count": 0})
                if s.name == family.name + "_bucket":
                    entry["buckets"].append((float(s.labels["le"]), s.value))
                elif s.name == family.name + "_sum":
                    entry["sum"] = float(s.value)
                elif s.name == family.name + "_count":
                    entry["count"] = int(s.value)
            points = []
            for entry in series.values():
                buckets = sorted(entry["buckets"])
                bounds = [le for le, _ in buckets if not math.isinf(le)]
                cumulative_counts = [int(c) for _, c in buckets]
                counts = [c - p for c, p in zip(cumulative_counts, [0] + cumulative_counts[:-1])]
                if len(counts) == len(bounds):  # no +Inf bucket reported
                    counts.append(entry["count"] - sum(counts))
                points.append(HistogramDataPoint(
                    attributes=entry["labels"], start_time_unix_nano=start_time_ns,
                    time_unix_nano=now, count=entry["count"], sum=entry["sum"],
                    bucket_counts=counts, explicit_bounds=bounds, min=None, max=None))
            if not points:
                continue
            data = Histogram(points, cumulative)
        else:
            continue
        metrics.append(Metric(name=family.name, description=family.documentation, unit="",
                              data=data))
    return metrics


class PrometheusOtlpBridge:
    """Pushes the process's Prometheus metrics (the same values /metrics serves) to an OTLP
    endpoint every `interval_s` (OTEL_METRIC_EXPORT_INTERVAL), and once more at shutdown."""

    def __init__(self, exporter, resource, interval_s: float = 60.0, registry=None):
        import prometheus_client
        self.exporter, self.resource = exporter, resource
        self.interval_s = max(interval_s, 0.05)
        self.registry = registry or prometheus_client.REGISTRY
        self.start_time_ns = time.time_ns()
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otlp-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def export_once(self) -> None:
        from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        metrics = prometheus_to_otlp(self.registry, self.start_time_ns)
        if not metrics:
            return
        scope = ScopeMetrics(InstrumentationScope("specdecode.prometheus"), metrics, schema_url="")
        data = MetricsData([ResourceMetrics(self.resource, [scope], schema_url="")])
        result = self.exporter.export(data)
        if getattr(result, "name", "SUCCESS") != "SUCCESS":
            raise RuntimeError(f"the exporter reported {result.name}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._safe_export()

    def _safe_export(self) -> None:
        try:
            self.export_once()
            self._failing = False
        except Exception as exc:  # an unreachable collector must not take a server down
            self._failing = True
            log.warning("OTLP metrics export failed: %s", exc)

    def shutdown(self) -> None:
        """Stop the thread and push the final values, unless the last push failed (a dead
        collector must not hold up a draining server for another export timeout)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if not self._failing:
            self._safe_export()
        self.exporter.shutdown()
