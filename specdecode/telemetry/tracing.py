"""Tracing helpers for library code: the OpenTelemetry *API* only. With no SDK configured
(see specdecode.telemetry.otel_setup) every span is a no-op and every helper returns at once.

Sampling rule for internal, client and continued server spans: they are created only under
a *sampled* parent. An unsampled parent (a request the sampler dropped, or a step the
step-span sampling skips) therefore silences everything below it, in this process and,
through the unsampled W3C `traceparent` it propagates, in the proposer and scorer too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import (INVALID_SPAN, Link, NonRecordingSpan, SpanContext, SpanKind,
                                 Status, StatusCode, TraceFlags)

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
        sc = self.span.get_span_context()
        self.context = trace.set_span_in_context(self.span) if sc.is_valid else None
        # A Prometheus exemplar linking a latency sample to this trace (sampled spans only).
        self.exemplar = ({"trace_id": format(sc.trace_id, "032x")}
                         if sc.is_valid and sc.trace_flags.sampled else None)
        self._ended = False

    @property
    def ended(self) -> bool:
        return self._ended

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
