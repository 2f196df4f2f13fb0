"""Draining on a real server on loopback: from the moment the stop is signalled, a new call
gets UNAVAILABLE (even before grpcio's own stop begins), health checks are still answered,
and a stream already in flight runs to its end."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdecode.serving.server import Draining


async def _echo(request, context):
    return request


async def _count(request, context):
    for i in range(50):
        await asyncio.sleep(0.01)
        yield bytes([i])


async def _drain_before_stop() -> None:
    stopping = asyncio.Event()
    server = grpc.aio.server(interceptors=[Draining(stopping)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("specdecode.test.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(_echo),
        "Stream": grpc.unary_stream_rpc_method_handler(_count)})])
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary = channel.unary_unary("/specdecode.test.Echo/Unary")
            assert await unary(b"before") == b"before"
            in_flight = channel.unary_stream("/specdecode.test.Echo/Stream")(b"")
            first = await in_flight.read()
            stopping.set()  # the signal: grpcio's stop has not begun
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await unary(b"after")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_stream("/specdecode.test.Echo/Stream")(b"").read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING  # not flipped yet
            got = [first]
            while (message := await in_flight.read()) is not grpc.aio.EOF:
                got.append(message)
            assert got == [bytes([i]) for i in range(50)]
    finally:
        await server.stop(None)


def test_a_call_after_the_signal_is_refused_and_one_in_flight_finishes():
    asyncio.run(_drain_before_stop())
