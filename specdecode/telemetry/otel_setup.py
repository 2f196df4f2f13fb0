"""OpenTelemetry SDK set-up for entry points only, from the standard `OTEL_*` environment
variables: the tracer provider; for OTLP metrics, the Prometheus->OTLP bridge (the metrics
/metrics serves) and a MeterProvider for the instruments made through the OpenTelemetry
metrics API (the GenAI conventions' gen_ai.server.* histograms). The SDK and exporters are
imported inside these functions and nowhere else.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Mapping

from opentelemetry import trace

log = logging.getLogger(__name__)

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


def build_meter_provider(role: str, env: Mapping[str, str]):
    """An SDK MeterProvider exporting to OTLP every OTEL_METRIC_EXPORT_INTERVAL ms (and at
    shutdown)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    reader = PeriodicExportingMetricReader(
        _otlp_exporter(env, "METRICS"),
        export_interval_millis=float(env.get("OTEL_METRIC_EXPORT_INTERVAL", 60000)))
    return MeterProvider(metric_readers=[reader], resource=build_resource(role, env),
                         shutdown_on_exit=False)


class Telemetry:
    """What `configure` set up; `shutdown` flushes and stops it (call it on exit)."""

    def __init__(self, tracer_provider=None, metrics_bridge: PrometheusOtlpBridge | None = None,
                 meter_provider=None):
        self.tracer_provider = tracer_provider
        self.metrics_bridge = metrics_bridge
        self.meter_provider = meter_provider

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    def shutdown(self) -> None:
        if self.metrics_bridge is not None:
            self.metrics_bridge.shutdown()
            self.metrics_bridge = None
        if self.meter_provider is not None:
            self.meter_provider.shutdown()  # a last export
            self.meter_provider = None
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
    bridge = meters = None
    if metrics_exporter_enabled(env):
        bridge = PrometheusOtlpBridge(_otlp_exporter(env, "METRICS"), build_resource(role, env),
                                      interval_s=float(env.get("OTEL_METRIC_EXPORT_INTERVAL",
                                                               60000)) / 1000)
        meters = build_meter_provider(role, env)
    if set_global:
        if provider is not None:
            trace.set_tracer_provider(provider)
        if bridge is not None:
            bridge.start()
        if meters is not None:
            from opentelemetry import metrics
            metrics.set_meter_provider(meters)
    return Telemetry(provider, bridge, meters)


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
    """Pushes the process's Prometheus metrics (what /metrics serves: the same values, with
    the model_name label) to an OTLP endpoint every `interval_s`
    (OTEL_METRIC_EXPORT_INTERVAL), and once more at shutdown."""

    def __init__(self, exporter, resource, interval_s: float = 60.0, registry=None):
        from specdecode.telemetry.served_metrics import SERVED
        self.exporter, self.resource = exporter, resource
        self.interval_s = max(interval_s, 0.05)
        self.registry = registry or SERVED
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
