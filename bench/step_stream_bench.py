"""Unary call per step vs one long-lived bidirectional stream, side by side: the round trip
of one step's request and response on loopback, with grpcio's sync client (what the
orchestrator's remote clients use) against a grpc.aio server (what the services run).

    python bench/step_stream_bench.py [--calls 2000] [--sizes 200,10000,100000]

Sizes are request bytes (the response is as large): ~200 B is a greedy delta step at B=1,
~10 KB a sampled step's sparse probabilities, ~100 KB a large batch.
"""

from __future__ import annotations

import asyncio
import json
import queue
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click
import grpc
from rich.console import Console
from rich.table import Table

from specdecode_stack.local import free_port

METHOD_UNARY = "/bench.Echo/Unary"
METHOD_STREAM = "/bench.Echo/Stream"


async def _unary(request: bytes, context) -> bytes:
    return request


async def _stream(requests, context):
    async for request in requests:
        yield request


async def serve(port: int) -> None:
    """The echo server (run in its own process: `--serve PORT`)."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream)})])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def measure(address: str, size: int, calls: int) -> dict[str, float]:
    payload = b"x" * size
    with grpc.insecure_channel(address) as channel:
        unary = channel.unary_unary(METHOD_UNARY)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            unary(payload)
            times.append(time.perf_counter() - t)
        unary_ms = 1000 * statistics.median(times[calls // 10:])

        requests: queue.Queue = queue.Queue()
        responses = channel.stream_stream(METHOD_STREAM)(iter(requests.get, None))
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            requests.put(payload)
            next(responses)
            times.append(time.perf_counter() - t)
        requests.put(None)
        stream_ms = 1000 * statistics.median(times[calls // 10:])
    return {"size": size, "unary_ms": unary_ms, "stream_ms": stream_ms}


@click.command()
@click.option("--calls", default=2000, show_default=True)
@click.option("--sizes", default="200,10000,100000", show_default=True)
@click.option("--out", default="bench/results/step_stream.json", show_default=True)
@click.option("--serve", "serve_port", default=0, hidden=True)
def main(calls: int, sizes: str, out: str, serve_port: int) -> None:
    if serve_port:
        asyncio.run(serve(serve_port))
        return
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        rows = [measure(f"127.0.0.1:{port}", int(s), calls) for s in sizes.split(",")]
    finally:
        server.kill()
    table = Table(title=f"step round trip on loopback, server in another process, median of "
                        f"{calls} (first 10% dropped)")
    for col in ("bytes each way", "unary ms", "stream ms", "saved ms"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["size"]), f"{r['unary_ms']:.3f}", f"{r['stream_ms']:.3f}",
                      f"{r['unary_ms'] - r['stream_ms']:.3f}")
    Console(width=120).print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
