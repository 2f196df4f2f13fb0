"""Telemetry in-process: the set-up function, step-span sampling and the span model of the
engine, the log formats, and the Prometheus->OTLP metrics conversion."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import time

import grpc
import prometheus_client
from prometheus_client.core import GaugeMetricFamily
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from opentelemetry.util._once import Once

from specdecode import logs, otel_setup, tracing
from specdecode.errors import InvalidRequestError
from specdecode.served_metrics import ModelNameLabel
from specdecode.server import Deferred, ServerTracing, map_errors
from tests.conftest import greedy_request, make_engine

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}


# -- set-up ---------------------------------------------------------------------------------

@pytest.mark.parametrize("env", [
    {},
    # What the Helm chart sets when no endpoint is configured.
    {"OTEL_SERVICE_NAME": "specdecode-scorer", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
     "OTEL_TRACES_SAMPLER_ARG": "1.0", "OTEL_TRACES_EXPORTER": "none",
     "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=p"},
    {**ENDPOINT, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"},
    {**ENDPOINT, "OTEL_SDK_DISABLED": "true"},
])
def test_unconfigured_creates_nothing_and_prints_nothing(env, capfd):
    before = trace.get_tracer_provider()
    t = otel_setup.configure("scorer", env=env)
    assert t.tracer_provider is None and t.metrics_bridge is None and not t.tracing
    assert trace.get_tracer_provider() is before
    assert not tracing.enabled()
    with tracing.child_span("x") as span:  # the library's spans are no-ops
        assert not span.is_recording()
    t.shutdown()
    out = capfd.readouterr()
    assert out.out == "" and out.err == ""


def test_exporter_choice():
    assert otel_setup.trace_exporter_names(ENDPOINT) == ["otlp"]
    assert otel_setup.trace_exporter_names({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "x"}) == ["otlp"]
    assert otel_setup.trace_exporter_names({}, console=True) == ["console"]
    assert otel_setup.trace_exporter_names(ENDPOINT, console=True) == ["otlp", "console"]
    assert otel_setup.trace_exporter_names({"OTEL_TRACES_EXPORTER": "console"}) == ["console"]
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER: 'zipkin'"):
        otel_setup.trace_exporter_names({"OTEL_TRACES_EXPORTER": "zipkin"})
    assert otel_setup.metrics_exporter_enabled(ENDPOINT)
    assert not otel_setup.metrics_exporter_enabled({})
    assert not otel_setup.metrics_exporter_enabled({**ENDPOINT, "OTEL_METRICS_EXPORTER": "none"})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        otel_setup.configure("scorer", env={**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
                            set_global=False)
    # Both protocols the chart offers (otel.protocol) have their exporter installed.
    for protocol, module in (("grpc", "grpc"), ("http/protobuf", "http")):
        env = {**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
        for signal in ("TRACES", "METRICS"):
            exporter = otel_setup._otlp_exporter(env, signal)
            assert type(exporter).__module__.startswith(
                f"opentelemetry.exporter.otlp.proto.{module}."), (protocol, signal)


def test_configured_provider_resource_and_console(capfd):
    env = {**ENDPOINT, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "sd-proposer",
           "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,team=a%20b"}
    t = otel_setup.configure("proposer", console=True, env=env, set_global=False)
    try:
        attrs = t.tracer_provider.resource.attributes
        assert attrs["service.name"] == "sd-proposer"
        assert attrs["deployment.environment"] == "test" and attrs["team"] == "a b"
        assert attrs["specdecode.role"] == "proposer"
        assert t.metrics_bridge is not None  # an endpoint alone turns OTLP metrics on
        t.tracer_provider.get_tracer("t").start_span("hello").end()
    finally:
        t.metrics_bridge.exporter.shutdown()  # never started: nothing to flush
        t.metrics_bridge = None
        t.shutdown()
    printed = capfd.readouterr().out
    assert json.loads(printed)["name"] == "hello"
    default = otel_setup.build_resource("scorer", {})
    assert default.attributes["service.name"] == "specdecode-scorer"


def test_parse_trace_steps():
    assert tracing.parse_trace_steps("all") == 1
    assert tracing.parse_trace_steps("none") == 0
    assert tracing.parse_trace_steps("5") == 5
    assert tracing.parse_trace_steps(0) == 0
    for bad in ("-1", "some"):
        with pytest.raises(ValueError):
            tracing.parse_trace_steps(bad)


# -- spans of the engine --------------------------------------------------------------------

@pytest.fixture
def exporter():
    """A global SDK provider with an in-memory exporter, restored afterwards (the API lets a
    process set its provider once; tests reset that guard)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    saved = trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace.set_tracer_provider(provider)
    try:
        yield memory
    finally:
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved
        provider.shutdown()


def traced_requests(prompts, max_tokens=16):
    spans, requests = [], []
    for i, prompt in enumerate(prompts):
        span = tracing.RequestSpan("spec_decode.request", {"specdecode.request_id": f"r{i}"})
        request = greedy_request(f"r{i}", prompt, max_tokens)
        request.trace_context = span.context
        spans.append(span)
        requests.append(request)
    return spans, requests


def run_engine(target_model, draft_model, trace_every, prompts=([5, 17, 99, 3],), max_tokens=16):
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)
    engine.trace_every = trace_every
    spans, requests = traced_requests(prompts, max_tokens)
    done = engine.generate(requests)
    for span in spans:
        span.end()
    return engine, done


def by_name(spans, name):
    return [s for s in spans if s.name == name]


def test_step_spans_sit_in_the_request_trace(exporter, target_model, draft_model):
    engine, done = run_engine(target_model, draft_model, trace_every=1)
    spans = exporter.get_finished_spans()
    (request,) = by_name(spans, "spec_decode.request")
    steps = by_name(spans, "spec_decode.step")
    assert len(steps) == engine.steps == done["r0"].stats.steps
    assert {s.context.trace_id for s in spans} == {request.context.trace_id}
    assert all(s.parent.span_id == request.context.span_id for s in steps)
    step_ids = {s.context.span_id for s in steps}
    for name in ("propose", "score", "rejection_sample"):
        children = by_name(spans, name)
        # The prompt's step has nothing to propose: no proposer call, no propose span.
        expected = len(steps) - (name == "propose")
        assert len(children) == expected and all(c.parent.span_id in step_ids for c in children)
    assert sum(s.attributes["specdecode.accepted_tokens"] for s in steps) >= \
        done["r0"].stats.accepted_tokens  # vLLM 0.4.2's count >= the prefixes received
    assert sum(s.attributes["specdecode.draft_tokens"] for s in steps) == \
        done["r0"].stats.draft_tokens
    assert sum(s.attributes["specdecode.new_tokens"] for s in steps) == 16


@pytest.mark.parametrize("every", [0, 3])
def test_step_sampling_drops_step_spans_and_their_children(exporter, target_model, draft_model,
                                                           every):
    engine, done = run_engine(target_model, draft_model, trace_every=every)
    spans = exporter.get_finished_spans()
    kept = 0 if every == 0 else math.ceil(engine.steps / every)
    assert len(by_name(spans, "spec_decode.step")) == kept
    for name in ("propose", "score", "rejection_sample", "batch_expansion.expand",
                 "target_model.forward", "batch_expansion.contract"):
        # Step 0 (always kept when any is) is the prompt's: it makes no proposer call.
        assert len(by_name(spans, name)) == (max(kept - 1, 0) if name == "propose" else kept)
    assert len(by_name(spans, "spec_decode.request")) == 1
    # Nothing from an untraced step: every other span descends from a kept step span.
    parents = {s.context.span_id: s for s in spans}
    for span in spans:
        while span.name not in ("spec_decode.step", "spec_decode.request"):
            span = parents[span.parent.span_id]
    assert len(by_name(spans, "draft_model.forward")) <= 3 * kept


def test_a_shared_step_links_the_other_requests(exporter, target_model, draft_model):
    engine, done = run_engine(target_model, draft_model, 1, prompts=([5, 17, 99, 3], [42], [9] * 5))
    spans = exporter.get_finished_spans()
    requests = {s.attributes["specdecode.request_id"]: s
                for s in by_name(spans, "spec_decode.request")}
    first = by_name(spans, "spec_decode.step")[0]
    assert first.attributes["specdecode.batch_size"] == 3
    assert first.parent.span_id == requests["r0"].context.span_id  # the oldest request
    assert list(first.attributes["specdecode.request_ids"]) == ["r0", "r1", "r2"]
    assert {link.context.span_id for link in first.links} == \
        {requests["r1"].context.span_id, requests["r2"].context.span_id}


def test_unsampled_requests_make_no_step_spans(exporter, target_model, draft_model):
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)
    request = greedy_request("r0", [5, 17, 99, 3], 8)
    sc = trace.SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=trace.TraceFlags(0))
    request.trace_context = trace.set_span_in_context(trace.NonRecordingSpan(sc))
    engine.generate([request])
    assert exporter.get_finished_spans() == ()


def test_a_failed_step_records_the_error(exporter, target_model, draft_model):
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)

    def broken(*args, **kwargs):  # the prompt's step calls the scorer only
        raise RuntimeError("scorer is gone")
    engine.scorer.score_proposals = broken
    spans, requests = traced_requests([[5, 17, 99, 3]])
    engine.add_request(requests[0])
    with pytest.raises(RuntimeError):
        engine.step()
    (step,) = by_name(exporter.get_finished_spans(), "spec_decode.step")
    (score,) = by_name(exporter.get_finished_spans(), "score")
    for span in (step, score):
        assert span.status.status_code == StatusCode.ERROR
        assert any(e.name == "exception" and "scorer is gone" in e.attributes["exception.message"]
                   for e in span.events)


def test_a_failed_step_is_logged_in_the_request_trace(exporter, target_model, draft_model):
    from orchestrator.engine.loop import EngineLoop
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)

    def broken(*args, **kwargs):  # the prompt's step calls the scorer only
        raise RuntimeError("scorer is gone")
    engine.scorer.score_proposals = broken
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.addFilter(logs.TraceContextFilter())
    handler.emit = records.append
    logging.getLogger("orchestrator.engine.loop").addHandler(handler)
    spans, requests = traced_requests([[5, 17, 99, 3]])
    loop, results = EngineLoop(engine), []
    loop.start()
    try:
        loop.submit(requests[0], results.append)
        for _ in range(200):
            if results:
                break
            time.sleep(0.01)
    finally:
        loop.stop()
        logging.getLogger("orchestrator.engine.loop").removeHandler(handler)
    assert isinstance(results[0], RuntimeError)
    (failed,) = [r for r in records if r.getMessage().startswith("step failed")]
    assert failed.trace_id == format(spans[0].span.get_span_context().trace_id, "032x")


def test_tracing_off_engine_makes_no_spans(target_model, draft_model):
    assert not tracing.enabled()
    engine, done = run_engine(target_model, draft_model, trace_every=1, max_tokens=4)
    assert done["r0"].stats.steps  # ran, with nothing to export to


# -- server spans (the aio interceptor) ------------------------------------------------------

SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
UNSAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


class _Echo(Deferred):
    loaded = True

    @map_errors
    async def Unary(self, request, context):
        if request == b"bad":
            raise InvalidRequestError("prompt", "must not be empty")
        if request == b"boom":
            raise RuntimeError("kaput")
        with tracing.child_span("inner"):
            return request

    async def Stream(self, request, context):
        for i in range(200):
            await asyncio.sleep(0.01)
            yield bytes([i])


async def _calls(start_traces: bool) -> None:
    server = grpc.aio.server(interceptors=[ServerTracing(start_traces)])
    echo = _Echo()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("specdecode.test.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(echo.Unary),
        "Stream": grpc.unary_stream_rpc_method_handler(echo.Stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary = channel.unary_unary("/specdecode.test.Echo/Unary")
            stream = channel.unary_stream("/specdecode.test.Echo/Stream")
            assert await unary(b"ok", metadata=[("traceparent", SAMPLED)]) == b"ok"
            assert await unary(b"quiet", metadata=[("traceparent", UNSAMPLED)]) == b"quiet"
            assert await unary(b"root") == b"root"
            for bad, code in ((b"bad", grpc.StatusCode.INVALID_ARGUMENT),
                              (b"boom", grpc.StatusCode.INTERNAL)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await unary(bad, metadata=[("traceparent", SAMPLED)])
                assert err.value.code() == code
            assert len([m async for m in stream(b"", metadata=[("traceparent", SAMPLED)])]) == 200
            call = stream(b"", metadata=[("traceparent", SAMPLED)])
            await call.read()
            call.cancel()
            await asyncio.sleep(0.3)  # the server notices and ends the span
    finally:
        await server.stop(None)


@pytest.mark.parametrize("start_traces", [True, False])
def test_server_spans_continue_the_callers_trace(exporter, start_traces):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.addFilter(logs.TraceContextFilter())
    handler.emit = records.append
    logging.getLogger("specdecode.server").addHandler(handler)
    try:
        asyncio.run(_calls(start_traces))
    finally:
        logging.getLogger("specdecode.server").removeHandler(handler)
    (failed,) = [r for r in records if r.getMessage() == "_Echo.Unary failed"]
    assert failed.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"  # the log line is in the trace
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind == trace.SpanKind.SERVER]
    unary = [s for s in servers if s.name == "specdecode.test.Echo/Unary"]
    # ok, bad, boom continue the caller's trace; "quiet" is unsampled; "root" has no context
    assert len(unary) == (4 if start_traces else 3)
    continued = [s for s in unary if s.parent is not None]
    assert len(continued) == 3
    assert all(s.parent.span_id == 0x00f067aa0ba902b7 and s.parent.is_remote for s in continued)
    assert {s.context.trace_id for s in continued} == {0x4bf92f3577b34da6a3ce929d0e0e4736}
    codes = sorted(s.attributes["rpc.grpc.status_code"] for s in unary)
    assert codes == ([0, 0, 3, 13] if start_traces else [0, 3, 13])
    inner = [s for s in spans if s.name == "inner"]  # under "ok" (and "root"), not "quiet"
    assert len(inner) == (2 if start_traces else 1)
    assert {s.parent.span_id for s in inner} <= {s.context.span_id for s in unary}
    by_code = {s.attributes["rpc.grpc.status_code"]: s for s in continued}
    assert by_code[3].status.status_code != StatusCode.ERROR  # the client's fault
    assert any(e.name == "exception" for e in by_code[3].events)
    assert by_code[13].status.status_code == StatusCode.ERROR
    assert failed.span_id == format(by_code[13].context.span_id, "016x")
    assert "kaput" in by_code[13].status.description
    assert any("kaput" in e.attributes["exception.message"] for e in by_code[13].events)
    streams = sorted((s for s in servers if s.name == "specdecode.test.Echo/Stream"),
                     key=lambda s: s.attributes["rpc.grpc.status_code"])
    assert [s.attributes["rpc.grpc.status_code"] for s in streams] == [0, 1]  # OK, CANCELLED
    assert all(s.status.status_code != StatusCode.ERROR for s in streams)


# -- logs -----------------------------------------------------------------------------------

def log_lines(fmt, emit) -> list[str]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs.TraceContextFilter())
    handler.setFormatter(logs.JsonFormatter("specdecode-test") if fmt == "json"
                         else logs.TextFormatter())
    logger = logging.getLogger("specdecode.test_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue().splitlines()


def test_json_logs_carry_trace_and_span_ids(exporter):
    def emit(logger):
        logger.info("outside")
        with tracing.tracer("t").start_as_current_span("work"):
            logger.info("inside %d", 1, extra={"fields": {"rate": float("nan"), "n": 2}})
            try:
                raise ValueError("boom")
            except ValueError:
                logger.exception("failed")
    outside, inside, failed = [json.loads(line) for line in log_lines("json", emit)]
    (span,) = exporter.get_finished_spans()
    assert "trace_id" not in outside and outside["message"] == "outside"
    assert outside["service"] == "specdecode-test" and outside["level"] == "INFO"
    assert inside["trace_id"] == format(span.context.trace_id, "032x")
    assert inside["span_id"] == format(span.context.span_id, "016x")
    assert inside["message"] == "inside 1" and inside["n"] == 2 and inside["rate"] == "nan"
    assert "ValueError: boom" in failed["exception"] and failed["level"] == "ERROR"


def test_text_logs_append_trace_ids(exporter):
    def emit(logger):
        with tracing.tracer("t").start_as_current_span("work"):
            logger.info("hello")
    (line,) = log_lines("text", emit)
    (span,) = exporter.get_finished_spans()
    assert line.endswith(f"hello trace_id={span.context.trace_id:032x} "
                         f"span_id={span.context.span_id:016x}")


# -- Prometheus -> OTLP ---------------------------------------------------------------------

def test_prometheus_registry_converts_to_otlp_metrics():
    registry = prometheus_client.CollectorRegistry()
    c = prometheus_client.Counter("specdecode_things", "Things.", ["kind"], registry=registry)
    g = prometheus_client.Gauge("specdecode_level", "Level.", registry=registry)
    h = prometheus_client.Histogram("specdecode_wait_seconds", "Wait.", buckets=(0.1, 1.0),
                                    registry=registry)
    prometheus_client.Counter("other_total", "Not ours.", registry=registry).inc()
    c.labels("a").inc(3)
    g.set(float("nan"))
    for v in (0.05, 0.5, 0.7, 5.0):
        h.observe(v)
    metrics = {m.name: m for m in otel_setup.prometheus_to_otlp(registry, start_time_ns=1)}
    assert set(metrics) == {"specdecode_things", "specdecode_level", "specdecode_wait_seconds"}
    (point,) = metrics["specdecode_things"].data.data_points
    assert metrics["specdecode_things"].data.is_monotonic
    assert point.value == 3 and point.attributes == {"kind": "a"}
    assert point.start_time_unix_nano == 1
    assert math.isnan(metrics["specdecode_level"].data.data_points[0].value)
    (hp,) = metrics["specdecode_wait_seconds"].data.data_points
    assert list(hp.explicit_bounds) == [0.1, 1.0] and list(hp.bucket_counts) == [1, 2, 1]
    assert hp.count == 4 and hp.sum == pytest.approx(6.25)
    # a ModelNameLabel view (what /metrics serves) gives every point its model_name
    view = ModelNameLabel(registry)
    view.model_name = "m"
    labelled = otel_setup.prometheus_to_otlp(view, start_time_ns=1)
    assert {p.attributes.get("model_name") for m in labelled for p in m.data.data_points} == {"m"}
    # the view labels copies: a collector that hands out the same family each time (as
    # python_info does) keeps its own samples, so a later model_name is not shadowed
    families = [GaugeMetricFamily("specdecode_fixed", "Fixed.", 1.0)]
    registry.register(type("Fixed", (), {"collect": lambda self: families})())
    list(view.collect())
    view.model_name = "later"
    assert families[0].samples[0].labels == {}
    fixed = [f for f in view.collect() if f.name == "specdecode_fixed"]
    assert fixed[0].samples[0].labels == {"model_name": "later"}
    # and the OTLP encoder accepts them
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    data = MetricsData([ResourceMetrics(Resource.create({}), [ScopeMetrics(
        InstrumentationScope("s"), list(metrics.values()), "")], "")])
    encoded = encode_metrics(data)
    names = {m.name for m in encoded.resource_metrics[0].scope_metrics[0].metrics}
    assert names == set(metrics)
