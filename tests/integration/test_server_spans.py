"""Server spans (the grpc.aio interceptor) on a real server on loopback: a span per call
that continues the caller's trace, status codes, errors logged in the trace."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from specdecode.telemetry import logs, tracing
from specdecode.errors import InvalidRequestError
from specdecode.serving.server import Deferred, ServerTracing, map_errors

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
    logging.getLogger("specdecode.serving.server").addHandler(handler)
    try:
        asyncio.run(_calls(start_traces))
    finally:
        logging.getLogger("specdecode.serving.server").removeHandler(handler)
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
