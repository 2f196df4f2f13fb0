"""Time per token against context length, through the gRPC stack (`specdecode up`): one
request at a time, num_speculative_tokens 0 (plain decoding by the scorer), greedy.

    python bench/context_bench.py [--contexts 200,3000] [--max-tokens 24] [--repeats 3]

The prompt is code text repeated up to the context length (token ids). Time per token is
the median gap between streamed tokens after the first (the first token carries the prefill).
Contexts run interleaved `repeats` times in one stack; the table reports medians and the ratio
to the shortest context. Quote ratios from one run: the machine may be shared.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from specdecode.api.client import SpecDecodeClient
from specdecode.models.checkpoints import load_tokenizer
from specdecode_stack.local import LocalStack, StackConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from engine_bench import CODE_PROMPTS  # noqa: E402


def prompt_of(tokenizer, n: int) -> list[int]:
    ids = tokenizer("".join(CODE_PROMPTS[:3]) * 200).input_ids
    return ids[:n]


def token_gaps(client: SpecDecodeClient, prompt: list[int], max_tokens: int) -> dict:
    arrivals, tokens = [], 0
    start = time.perf_counter()
    for response in client.stream(prompt, max_tokens=max_tokens, num_speculative_tokens=0):
        if response.token_ids:
            arrivals.append(time.perf_counter())
            tokens += len(response.token_ids)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"first_token_s": arrivals[0] - start, "tokens": tokens,
            "ms_per_token": statistics.median(gaps) * 1000}


@click.command()
@click.option("--contexts", default="200,3000", show_default=True)
@click.option("--max-tokens", default=24, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--model", default=None, help="Target model (default: SmolLM2-135M-Instruct).")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--out", default="bench/results/context.json", show_default=True)
def main(contexts: str, max_tokens: int, repeats: int, model: str | None, dtype: str,
         out: str) -> None:
    lengths = [int(c) for c in contexts.split(",")]
    tokenizer = load_tokenizer(model)
    prompts = {n: prompt_of(tokenizer, n) for n in lengths}
    samples = {n: [] for n in lengths}
    config = StackConfig(target_model=model, device="cpu", dtype=dtype, port=0,
                         num_speculative_tokens=0)
    with LocalStack(config) as stack, SpecDecodeClient(stack.address) as client:
        token_gaps(client, prompts[lengths[0]][:32], 4)  # warm-up
        for _ in range(repeats):
            for n in lengths:
                samples[n].append(token_gaps(client, prompts[n], max_tokens))
    base = statistics.median(s["ms_per_token"] for s in samples[lengths[0]])
    table = Table(title=f"time per token vs context, gRPC stack, num_speculative_tokens 0, "
                        f"{model or 'SmolLM2-135M-Instruct'} {dtype}")
    for col in ("context", "ms/token (median)", f"vs {lengths[0]}", "first token s",
                "tokens"):
        table.add_column(col)
    rows = []
    for n in lengths:
        ms = statistics.median(s["ms_per_token"] for s in samples[n])
        first = statistics.median(s["first_token_s"] for s in samples[n])
        rows.append({"context": n, "ms_per_token": ms, "ratio": ms / base,
                     "first_token_s": first, "tokens": samples[n][0]["tokens"],
                     "samples": samples[n]})
        table.add_row(str(n), f"{ms:.1f}", f"{ms / base:.2f}x", f"{first:.2f}",
                      str(samples[n][0]["tokens"]))
    Console(width=140).print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
