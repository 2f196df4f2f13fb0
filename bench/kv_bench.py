"""The KV cache on a long context: the memory it holds against its budget, and the time a
token costs as the context grows.

    python bench/kv_bench.py memory [--model smollm2|kv-twin|tiny] [--sequences 200] [--budget 1GiB]
    python bench/kv_bench.py context [--contexts 200,3000] [--model tiny]

Each subcommand prints one table and writes JSON under bench/results/ (its --help says what it
measures); `--model tiny` runs each in seconds.
"""

from __future__ import annotations

import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import torch
from transformers import AutoConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the root: bench.harness
from bench.harness import (CODE_PROMPTS, CPU, RESULTS, load_named, ratio, save,  # noqa: E402
                           save_models, show)
from specdecode.api.client import SpecDecodeClient  # noqa: E402
from specdecode.models.model_loading import parse_size  # noqa: E402
from specdecode.executor.model_runner import ModelRunner, RunnerRow  # noqa: E402
from specdecode.models.checkpoints import load_tokenizer, resolve_model_dir  # noqa: E402
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model  # noqa: E402
from specdecode_stack.local import LocalStack, StackConfig  # noqa: E402


@click.group()
def cli() -> None:
    """The KV cache on a long context, one question per subcommand."""


# -- memory ------------------------------------------------------------------------------------


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


def kv_passes(runner: ModelRunner, seqs: list[list[int]], steps: int, batch: int) -> tuple[list, int, int]:
    """The prompts, then `steps` decode passes, every sequence taking turns in batches of
    `batch` rows; progress every 40 sequences. (passes, rows answered, peak tokens held)."""
    peak_held, answered, passes = 0, 0, []
    for step in range(steps + 1):
        t0, computed0 = time.perf_counter(), runner.stats.tokens_computed
        for i in range(0, len(seqs), batch):
            ids = range(i, min(i + batch, len(seqs)))
            for j, row in zip(ids, runner.forward([RunnerRow(j, seqs[j], 1) for j in ids])):
                seqs[j].append(int(row[-1].argmax()))
                answered += 1
            peak_held = max(peak_held, runner.pool.tokens_held)
            if (i + batch) % 40 < batch:
                print(f"pass {step}: {ids[-1] + 1} sequences, {time.perf_counter() - t0:.0f} s, "
                      f"{runner.stats.tokens_computed - computed0:,} tokens computed, "
                      f"{runner.pool.stats.evictions} evictions, "
                      f"peak RSS {peak_rss_mib():,.0f} MiB", flush=True)
        passes.append({"pass": "prompts" if step == 0 else f"decode {step}",
                       "seconds": time.perf_counter() - t0,
                       "tokens_computed": runner.stats.tokens_computed - computed0,
                       "evictions_so_far": runner.pool.stats.evictions,
                       "rss_peak_mib_so_far": peak_rss_mib()})
        print(passes[-1], flush=True)
    return passes, answered, peak_held


@cli.command()
@click.option("--sequences", default=200, show_default=True)
@click.option("--tokens", default=1000, show_default=True)
@click.option("--steps", default=2, show_default=True)
@click.option("--budget", default="1GiB", show_default=True)
@click.option("--batch", default=8, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--model", "model_name", type=click.Choice(["smollm2", "kv-twin", "tiny"]),
              default="smollm2", show_default=True)
@click.option("--out", default=str(RESULTS / "kv_memory.json"), show_default=True)
def memory(sequences, tokens, steps, budget, batch, dtype, model_name, out) -> None:
    """KV memory against its budget: many long sequences in flight through one model runner
    (what a service runs) with a pool far smaller than their keys and values. Every sequence
    gets a --tokens prompt, then --steps decode steps, all taking turns in batches; evicted
    sequences are recomputed on their next turn. Reports the pool against the budget, RSS
    after loading, at the end and its peak, what the pool holds, evictions and rows answered;
    "needed without a pool" is every sequence's keys and values. Models: smollm2, kv-twin (a
    random Llama with SmolLM2's KV geometry and ~10x cheaper projections: the same bytes per
    token, ~4x faster), tiny (a random 2-layer Llama: seconds)."""
    torch_dtype = getattr(torch, dtype)
    model = kv_twin(torch_dtype) if model_name == "kv-twin" else load_named(model_name, torch_dtype)
    reset_peak_rss()
    before, start = rss_mib(), time.perf_counter()
    runner = ModelRunner(model, CPU, kv_cache_memory=parse_size(budget), max_num_seqs=sequences)
    print(f"model loaded: RSS {before:,.0f} MiB; KV pool {runner.pool.nbytes / 2**20:,.0f} MiB "
          f"= {runner.pool.capacity_tokens:,} tokens of {runner.bytes_per_token:,} bytes", flush=True)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, runner.vocab_size, (tokens,), generator=gen).tolist()
            for _ in range(sequences)]
    passes, answered, peak_held = kv_passes(runner, seqs, steps, batch)
    pool, peak = runner.pool, peak_rss_mib()
    row = {"model": model_name, "sequences": sequences, "tokens": tokens, "steps": steps,
           "dtype": dtype, "budget_bytes": parse_size(budget), "pool_bytes": pool.nbytes,
           "pool_within_budget": pool.nbytes <= parse_size(budget),
           "bytes_per_token": runner.bytes_per_token,
           "needed_without_pool_bytes": sequences * (tokens + steps) * runner.bytes_per_token,
           "rss_model_loaded_mib": before, "rss_after_mib": rss_mib(), "rss_peak_mib": peak,
           "rss_peak_over_model_mib": peak - before,
           "pool_capacity_tokens": pool.capacity_tokens, "peak_tokens_held": peak_held,
           "sequences_held_at_end": pool.num_sequences, "evictions": pool.stats.evictions,
           "relocations": pool.stats.relocations, "compactions": pool.stats.compactions,
           "rows_answered": answered, "rows_asked": sequences * (steps + 1),
           "tokens_computed": runner.stats.tokens_computed, "seconds": time.perf_counter() - start}
    show(f"KV memory: {sequences} sequences x {tokens} tokens, {model_name} {dtype}, budget "
         f"{budget}, batches of {batch}, {steps} decode steps", ("what", "value"),
         [(k, f"{v:,.1f}" if isinstance(v, float) else f"{v:,}"
           if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in row.items()],
         width=120)
    save(out, **row, passes=passes)


# -- context -----------------------------------------------------------------------------------


def token_gaps(client: SpecDecodeClient, prompt: list[int], max_tokens: int) -> dict:
    """One plain-decoding stream: its first token's time and the median gap after it."""
    arrivals, tokens = [], 0
    start = time.perf_counter()
    for response in client.stream(prompt, max_tokens=max_tokens, num_speculative_tokens=0):
        if response.token_ids:
            arrivals.append(time.perf_counter())
            tokens += len(response.token_ids)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"first_token_s": arrivals[0] - start, "tokens": tokens,
            "ms_per_token": statistics.median(gaps) * 1000}


def context_stack(model: str | None, dtype: str, longest: int) -> tuple[StackConfig, list[int]]:
    """The stack of `model` (tiny: a random Llama long enough, byte ids), and the code text
    repeated as token ids."""
    text = "".join(CODE_PROMPTS[:3]) * 200
    config = StackConfig(target_model=model, device="cpu", dtype=dtype, port=0,
                         num_speculative_tokens=0)
    if model != "tiny":
        return config, load_tokenizer(model)(text).input_ids
    tiny = build_tiny_model(TinyModelSpec(seed=1, max_position_embeddings=longest + 64))
    config.target_model = save_models(tempfile.mkdtemp(), tiny=tiny)["tiny"]
    config.tokenizer = "none"
    return config, [b % 256 for b in text.encode()]


@cli.command()
@click.option("--contexts", default="200,3000", show_default=True)
@click.option("--max-tokens", default=24, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--model", default=None, help="Target model (default: SmolLM2-135M-Instruct; "
              "tiny: a random 2-layer Llama).")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--out", default=str(RESULTS / "context.json"), show_default=True)
def context(contexts, max_tokens, repeats, model, dtype, out) -> None:
    """Time per token against context length through the gRPC stack (`specdecode up`): one
    request at a time, num_speculative_tokens 0 (plain decoding by the scorer), greedy; the
    prompt is code text repeated up to the context length. Time per token: the median gap
    between streamed tokens after the first (which carries the prefill). Contexts run
    interleaved --repeats times in one stack; medians, and the ratio to the shortest."""
    lengths = [int(c) for c in contexts.split(",")]
    config, ids = context_stack(model, dtype, max(lengths) + max_tokens)
    samples = {n: [] for n in lengths}
    with LocalStack(config) as stack, SpecDecodeClient(stack.address) as client:
        token_gaps(client, ids[:32], 4)  # warm-up
        for _ in range(repeats):
            for n in lengths:
                samples[n].append(token_gaps(client, ids[:n], max_tokens))
    med = {n: {key: statistics.median(s[key] for s in samples[n])
               for key in ("ms_per_token", "first_token_s")} for n in lengths}
    rows = [{"context": n, **med[n], "ratio": med[n]["ms_per_token"] / med[lengths[0]]["ms_per_token"],
             "tokens": samples[n][0]["tokens"], "samples": samples[n]} for n in lengths]
    show(f"time per token vs context, gRPC stack, num_speculative_tokens 0, "
         f"{model or 'SmolLM2-135M-Instruct'} {dtype}",
         ("context", "ms/token (median)", f"vs {lengths[0]}", "first token s", "tokens"),
         [(r["context"], f"{r['ms_per_token']:.1f}", ratio(r["ratio"]), f"{r['first_token_s']:.2f}",
           r["tokens"]) for r in rows])
    save(out, model=model, dtype=dtype, rows=rows)


if __name__ == "__main__":
    cli()
