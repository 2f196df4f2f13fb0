"""A long prompt joins beside a running stream (chunked prefill, docs/design.md): the
stream's largest inter-token gap against its median, side by side with the same statistic
of the stream alone (no join) over as many gaps, so the machine's and the stack's own
jitter is measured in the same run as the join.

    python bench/join_bench.py [--attempts 6] [--prompt-tokens 4000] [--budget 256]

Tiny random Llama models (specdecode/models/tiny_models.py), as in
tests/integration/test_long_prompt_join.py, whose join test asserts the first column (< 5x).
Per attempt: a stream runs 40 tokens, a prompt-tokens prompt joins (8 tokens asked), the
stream is measured from 30 tokens before the join until 10 tokens after the long request
ends; then the same stream runs alone for as many gaps.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from specdecode.api.client import SpecDecodeClient
from specdecode_stack.local import LocalStack, StackConfig
from join_stream import BEFORE, JOIN_AT, gaps_of, stream_with_join
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model

TARGET = TinyModelSpec(seed=1, max_position_embeddings=8192)  # tests/support/models.py's pair
DRAFT = TinyModelSpec(seed=2, num_layers=1, max_position_embeddings=8192)
SHORT = [5, 17, 99, 3]


def join_once(client: SpecDecodeClient, prompt: list[int]) -> tuple[list[float], float]:
    """The stream's gaps over the join window, and the long request's latency."""
    joined = stream_with_join(client, SHORT, prompt, long_max_tokens=8, stream_max_tokens=4000)
    return joined.window, joined.seconds


def alone(client: SpecDecodeClient, n: int) -> list[float]:
    """n gaps of the same stream with nothing beside it (after the same 10-token start)."""
    times = [time.perf_counter() for _ in client.stream(SHORT, max_tokens=n + JOIN_AT - BEFORE + 1)]
    return gaps_of(times)[JOIN_AT - BEFORE:][:n]


@click.command()
@click.option("--attempts", default=6, show_default=True)
@click.option("--prompt-tokens", default=4000, show_default=True)
@click.option("--budget", default=256, show_default=True, help="--max-num-batched-tokens")
@click.option("--out", default="bench/results/join.json", show_default=True)
def main(attempts: int, prompt_tokens: int, budget: int, out: str) -> None:
    root = Path(tempfile.mkdtemp())
    for name, spec in (("target", TARGET), ("draft", DRAFT)):
        build_tiny_model(spec).save_pretrained(root / name)
    config = StackConfig(target_model=str(root / "target"), draft_model=str(root / "draft"),
                         tokenizer="none", device="cpu", num_speculative_tokens=3, port=0,
                         orchestrator_args=["--max-num-batched-tokens", str(budget)],
                         log_file=str(root / "servers.log"))
    rows = []
    with LocalStack(config) as stack, SpecDecodeClient(stack.address) as client:
        client.generate(SHORT, max_tokens=4)  # warm up both services
        for attempt in range(attempts):
            prompt = torch.randint(0, 256, (prompt_tokens,),
                                   generator=torch.Generator().manual_seed(attempt)).tolist()
            window, seconds = join_once(client, prompt)
            control = alone(client, len(window))
            pace = statistics.median(window[:BEFORE - 1])  # the stream before the join
            rows.append({"gaps": len(window), "median_ms": statistics.median(window) * 1e3,
                         "pace_ms": pace * 1e3, "largest_ms": max(window) * 1e3,
                         "join_ratio": max(window) / statistics.median(window),
                         "join_vs_pace": max(window) / pace,
                         "alone_median_ms": statistics.median(control) * 1e3,
                         "alone_ratio": max(control) / statistics.median(control),
                         "join_seconds": seconds, "load": os.getloadavg()[0]})
    table = Table(title=f"a {prompt_tokens}-token prompt joins a running stream (budget {budget})")
    for col in ("gaps", "median ms", "largest ms", "largest / median", "largest / pace before",
                "alone: largest / median", "join s", "load"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["gaps"]), f"{r['median_ms']:.1f}", f"{r['largest_ms']:.1f}",
                      f"{r['join_ratio']:.2f}x", f"{r['join_vs_pace']:.2f}x ({r['pace_ms']:.1f} ms)",
                      f"{r['alone_ratio']:.2f}x ({r['alone_median_ms']:.1f} ms)",
                      f"{r['join_seconds']:.2f}", f"{r['load']:.1f}")
    Console(width=140).print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
