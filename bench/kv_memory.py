"""KV memory against its budget: many long sequences in flight through one model runner (what
a proposer or scorer service runs), with a pool far smaller than their keys and values.

    python bench/kv_memory.py [--sequences 200] [--tokens 1000] [--budget 1GiB] [--batch 8]

Every sequence gets a `tokens`-token prompt, then `steps` decode steps, all sequences taking
turns in batches of `batch` rows (as a server's steps would). Reports the pool's size, the
process's resident memory (RSS) before and at the end and its peak, what the pool holds, and
evictions; "needed without a pool" is what keeping every sequence's keys and values would take.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from specdecode.model_loading import parse_size
from specdecode.model_runner import ModelRunner, RunnerRow
from specdecode.models import load_model


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


@click.command()
@click.option("--sequences", default=200, show_default=True)
@click.option("--tokens", default=1000, show_default=True)
@click.option("--steps", default=2, show_default=True)
@click.option("--budget", default="1GiB", show_default=True)
@click.option("--batch", default=8, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--out", default="bench/results/kv_memory.json", show_default=True)
def main(sequences, tokens, steps, budget, batch, dtype, out) -> None:
    model = load_model(None, torch.device("cpu"), getattr(torch, dtype))
    before = rss_mib()
    runner = ModelRunner(model, torch.device("cpu"), kv_cache_memory=parse_size(budget),
                         max_num_seqs=sequences)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, runner.vocab_size, (tokens,), generator=gen).tolist()
            for _ in range(sequences)]
    peak_held, start = 0, time.perf_counter()
    for _ in range(steps + 1):  # the prompts, then decode steps
        for i in range(0, sequences, batch):
            ids = range(i, min(i + batch, sequences))
            logits = runner.forward([RunnerRow(j, seqs[j], 1) for j in ids])
            for j, row in zip(ids, logits):
                seqs[j].append(int(row[-1].argmax()))
            peak_held = max(peak_held, runner.pool.tokens_held)
    seconds = time.perf_counter() - start
    pool, after = runner.pool, rss_mib()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row = {"sequences": sequences, "tokens": tokens, "steps": steps, "dtype": dtype,
           "budget_bytes": parse_size(budget), "pool_bytes": pool.nbytes,
           "bytes_per_token": runner.bytes_per_token,
           "needed_without_pool_bytes": sequences * (tokens + steps) * runner.bytes_per_token,
           "rss_before_mib": before, "rss_after_mib": after, "rss_peak_mib": peak,
           "pool_capacity_tokens": pool.capacity_tokens, "peak_tokens_held": peak_held,
           "sequences_held_at_end": pool.num_sequences, "evictions": pool.stats.evictions,
           "relocations": pool.stats.relocations, "compactions": pool.stats.compactions,
           "tokens_computed": runner.stats.tokens_computed, "seconds": seconds}
    table = Table(title=f"KV memory: {sequences} sequences x {tokens} tokens, SmolLM2 {dtype}, "
                        f"budget {budget}, batches of {batch}, {steps} decode steps")
    table.add_column("what")
    table.add_column("value")
    for k, v in row.items():
        table.add_row(k, f"{v:,.1f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int)
                      else str(v))
    Console(width=120).print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
