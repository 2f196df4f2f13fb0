"""KV memory against its budget: many long sequences in flight through one model runner (what
a proposer or scorer service runs), with a pool far smaller than their keys and values.

    python bench/kv_memory.py [--sequences 200] [--tokens 1000] [--budget 1GiB] [--batch 8]
                              [--model smollm2|kv-twin]

Every sequence gets a `tokens`-token prompt, then `steps` decode steps, all sequences taking
turns in batches of `batch` rows (as a server's steps would): a pass is one turn of every
sequence. Sequences evicted meanwhile miss the pool on their next turn and are recomputed
(docs/design.md, Executor), so a decode pass computes far more than one token per sequence.
Reports the pool's size against the budget, the process's resident memory (RSS) after the
model is loaded, at the end and its peak since then, what the pool holds, evictions, and how
many rows were answered; "needed without a pool" is what keeping every sequence's keys and
values would take. Progress lines (every 40 sequences and at the end of each pass) give the
time, tokens computed, evictions and peak RSS so far.

Models: smollm2 (SmolLM2-135M-Instruct, the services' default model), or kv-twin: a random
Llama with SmolLM2's KV geometry (its layers, KV heads and head dim, read from its config: the
same bytes per token in the pool) whose projections are ~10x cheaper (hidden = KV heads x head
dim, one query head per KV head, MLP twice the hidden size). On 2 CPU cores SmolLM2 computes
~870 prompt tokens a second, so 200 x 1,000 tokens and a decode pass that recomputes the
evicted ones take ~8 minutes; the twin holds the same keys and values in ~2.
"""

from __future__ import annotations

import json
import re
import resource
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, LlamaForCausalLM

from specdecode.models.model_loading import parse_size
from specdecode.executor.model_runner import ModelRunner, RunnerRow
from specdecode.models.checkpoints import load_model, resolve_model_dir


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def reset_peak_rss() -> None:
    """Start the peak (VmHWM) afresh: loading the model peaks higher than running it (its
    float32 checkpoint is read before the cast), which is not what this measures."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) / 1024


def kv_twin(dtype: torch.dtype) -> LlamaForCausalLM:
    """SmolLM2's layers, KV heads, head dim and vocabulary with narrow random projections."""
    config = AutoConfig.from_pretrained(resolve_model_dir(None))
    hidden = config.num_key_value_heads * config.head_dim
    config.hidden_size, config.num_attention_heads = hidden, config.num_key_value_heads
    config.intermediate_size = 2 * hidden
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


@click.command()
@click.option("--sequences", default=200, show_default=True)
@click.option("--tokens", default=1000, show_default=True)
@click.option("--steps", default=2, show_default=True)
@click.option("--budget", default="1GiB", show_default=True)
@click.option("--batch", default=8, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--model", "model_name", type=click.Choice(["smollm2", "kv-twin"]),
              default="smollm2", show_default=True)
@click.option("--out", default="bench/results/kv_memory.json", show_default=True)
def main(sequences, tokens, steps, budget, batch, dtype, model_name, out) -> None:
    torch_dtype = getattr(torch, dtype)
    model = (kv_twin(torch_dtype) if model_name == "kv-twin"
             else load_model(None, torch.device("cpu"), torch_dtype))
    reset_peak_rss()
    before = rss_mib()
    runner = ModelRunner(model, torch.device("cpu"), kv_cache_memory=parse_size(budget),
                         max_num_seqs=sequences)
    print(f"model loaded: RSS {before:,.0f} MiB; KV pool {runner.pool.nbytes / 2**20:,.0f} MiB "
          f"= {runner.pool.capacity_tokens:,} tokens of {runner.bytes_per_token:,} bytes",
          flush=True)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, runner.vocab_size, (tokens,), generator=gen).tolist()
            for _ in range(sequences)]
    peak_held, answered, passes, start = 0, 0, [], time.perf_counter()
    for step in range(steps + 1):  # the prompts, then decode steps
        t0, computed0 = time.perf_counter(), runner.stats.tokens_computed
        for i in range(0, sequences, batch):
            ids = range(i, min(i + batch, sequences))
            logits = runner.forward([RunnerRow(j, seqs[j], 1) for j in ids])
            for j, row in zip(ids, logits):
                seqs[j].append(int(row[-1].argmax()))
                answered += 1
            peak_held = max(peak_held, runner.pool.tokens_held)
            if (i + batch) % 40 < batch:
                print(f"pass {step}: {min(i + batch, sequences)} sequences, "
                      f"{time.perf_counter() - t0:.0f} s, "
                      f"{runner.stats.tokens_computed - computed0:,} tokens computed, "
                      f"{runner.pool.stats.evictions} evictions, "
                      f"peak RSS {peak_rss_mib():,.0f} MiB", flush=True)
        passes.append({"pass": "prompts" if step == 0 else f"decode {step}",
                       "seconds": time.perf_counter() - t0,
                       "tokens_computed": runner.stats.tokens_computed - computed0,
                       "evictions_so_far": runner.pool.stats.evictions,
                       "rss_peak_mib_so_far": peak_rss_mib()})
        print(passes[-1], flush=True)
    seconds = time.perf_counter() - start
    pool, after, peak = runner.pool, rss_mib(), peak_rss_mib()
    row = {"model": model_name, "sequences": sequences, "tokens": tokens, "steps": steps,
           "dtype": dtype,
           "budget_bytes": parse_size(budget), "pool_bytes": pool.nbytes,
           "pool_within_budget": pool.nbytes <= parse_size(budget),
           "bytes_per_token": runner.bytes_per_token,
           "needed_without_pool_bytes": sequences * (tokens + steps) * runner.bytes_per_token,
           "rss_model_loaded_mib": before, "rss_after_mib": after, "rss_peak_mib": peak,
           "rss_peak_over_model_mib": peak - before,
           "pool_capacity_tokens": pool.capacity_tokens, "peak_tokens_held": peak_held,
           "sequences_held_at_end": pool.num_sequences, "evictions": pool.stats.evictions,
           "relocations": pool.stats.relocations, "compactions": pool.stats.compactions,
           "rows_answered": answered, "rows_asked": sequences * (steps + 1),
           "tokens_computed": runner.stats.tokens_computed, "seconds": seconds}
    table = Table(title=f"KV memory: {sequences} sequences x {tokens} tokens, {model_name} "
                        f"{dtype}, budget {budget}, batches of {batch}, {steps} decode steps")
    table.add_column("what")
    table.add_column("value")
    for k, v in row.items():
        table.add_row(k, f"{v:,.1f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int)
                      and not isinstance(v, bool) else str(v))
    Console(width=120).print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({**row, "passes": passes}, indent=2))


if __name__ == "__main__":
    main()
