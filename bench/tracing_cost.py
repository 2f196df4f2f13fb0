"""Cost of tracing: step time with spans exported vs not, inside one running stack.

    python bench/tracing_cost.py [--model tiny|smollm2] [--blocks 10] [--max-tokens 48]

Tracing is on (OTLP/gRPC to a receiver in another process, as a collector would be);
blocks of 4 concurrent requests alternate between a sampled and an unsampled W3C
traceparent, so the same processes run both and an unsampled request makes no span
anywhere. Step time comes from the orchestrator's /metrics. Reports the paired per-block
difference (median) as a share of the untraced step time; target: under 3%.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from specdecode.api.client import SpecDecodeClient, build_request
from specdecode.models.checkpoints import load_tokenizer
from specdecode_stack.local import LocalStack, StackConfig, free_port
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model

RECEIVER = """
import sys
from concurrent import futures
import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as m, metrics_service_pb2_grpc as mg
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as t, trace_service_pb2_grpc as tg
class Traces(tg.TraceServiceServicer):
    def Export(self, request, context): return t.ExportTraceServiceResponse()
class Metrics(mg.MetricsServiceServicer):
    def Export(self, request, context): return m.ExportMetricsServiceResponse()
server = grpc.server(futures.ThreadPoolExecutor(2))
tg.add_TraceServiceServicer_to_server(Traces(), server)
mg.add_MetricsServiceServicer_to_server(Metrics(), server)
server.add_insecure_port("127.0.0.1:" + sys.argv[1]); server.start(); server.wait_for_termination()
"""
PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
           "The capital of France is", "import numpy as np\nimport"]


def step_time(port: int) -> tuple[float, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    get = lambda n: float(re.search(rf"^{n} (\S+)$", body, re.M).group(1))  # noqa: E731
    return get("specdecode_step_duration_seconds_sum"), get("specdecode_step_duration_seconds_count")


def traceparent(sampled: bool) -> str:
    return f"00-{random.getrandbits(128):032x}-{random.getrandbits(64):016x}-{'01' if sampled else '00'}"


@click.command()
@click.option("--model", type=click.Choice(["tiny", "smollm2"]), default="tiny", show_default=True)
@click.option("--blocks", default=10, show_default=True, help="Block pairs (traced + untraced).")
@click.option("--max-tokens", default=48, show_default=True)
@click.option("--out", default="bench/results/tracing_cost.json", show_default=True)
def main(model: str, blocks: int, max_tokens: int, out: str) -> None:
    port = free_port()
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    tmp = tempfile.mkdtemp()
    if model == "tiny":
        build_tiny_model(TinyModelSpec(seed=1, hidden_size=256, num_layers=4)).save_pretrained(tmp)
        config = StackConfig(target_model=tmp, draft_model=tmp, tokenizer="none")
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (8, 16, 24, 32)]
    else:
        tok = load_tokenizer(None)
        config = StackConfig(draft_model="ngram")
        prompts = [tok(p).input_ids for p in PROMPTS]
    config.device, config.port, config.extra_env = "cpu", 0, env
    per_step = {"traced": [], "untraced": []}
    stack = LocalStack(config)
    try:
        stack.start()

        def one(i: int, sampled: bool) -> None:
            with SpecDecodeClient(stack.address) as client:
                request = build_request(prompts[i % len(prompts)], max_tokens=max_tokens)
                for _ in client.stub.Generate(request, metadata=[("traceparent", traceparent(sampled))]):
                    pass

        one(0, True), one(0, False)  # warm-up
        for b in range(blocks):
            for mode in (("traced", "untraced") if b % 2 else ("untraced", "traced")):
                s0, n0 = step_time(stack.metrics_ports["orchestrator"])
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    list(pool.map(lambda i: one(i, mode == "traced"), range(4)))
                s1, n1 = step_time(stack.metrics_ports["orchestrator"])
                per_step[mode].append(1000 * (s1 - s0) / (n1 - n0))
    finally:
        stack.stop()
        receiver.kill()
    untraced = statistics.median(per_step["untraced"])
    diffs = [t - u for t, u in zip(per_step["traced"], per_step["untraced"])]
    result = {"model": model, "blocks": blocks, "untraced_step_ms": untraced,
              "traced_step_ms": statistics.median(per_step["traced"]),
              "paired_diff_ms": statistics.median(diffs),
              "paired_diff_pct": 100 * statistics.median(diffs) / untraced}
    table = Table(title=f"tracing cost, {model}, {blocks} block pairs of 4 requests")
    for col in ("untraced step ms", "traced step ms", "paired difference", "share"):
        table.add_column(col)
    table.add_row(f"{untraced:.2f}", f"{result['traced_step_ms']:.2f}",
                  f"{result['paired_diff_ms']:+.2f} ms", f"{result['paired_diff_pct']:+.1f}%")
    Console(width=120).print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
