"""The executor on an accelerator: the one script a lent GPU runs (CI runs both subcommands
on CPU at small shapes).

    python bench/device_bench.py gpu --device cuda                  # Qwen2-1.5B / 0.5B-shaped, bf16
    python bench/device_bench.py gpu --device cuda --enforce-eager  # the same, eager forwards
    python bench/device_bench.py gpu --small --device cpu           # CPU, small shapes (a dry run)
    python bench/device_bench.py check --device cuda [--dtype bfloat16]
    python bench/device_bench.py check --device cpu --buckets 4 --configs draft:multi-query:4  # CI

Forwards are compiled (specdecode/executor/compiled_forward.py: torch.compile, CUDA graphs through
mode="reduce-overhead", flex attention over the KV pool) unless --enforce-eager. No package
beyond torch is needed on the device for the fast path.

Carry to a lent device (the repository travels as the working tree): a folder of wheels for
the device's Python, `pip download -d .whl --only-binary=:all: --python-version 3.11
transformers tokenizers safetensors huggingface-hub accelerate click rich grpcio
grpcio-health-checking grpcio-reflection protobuf opentelemetry-api opentelemetry-sdk
prometheus-client psutil pyyaml regex tqdm` (the pure-Python ones, plus the few small binary
wheels the imports need; torch and triton are the device image's), installed there with
`pip install --no-index --find-links .whl ...` before the run.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the root: bench.harness
from bench.harness import (RESULTS, fmt, forward_ms, hf_generate_batch, random_qwen2,  # noqa: E402
                           run_engine, save, show, sync, tiny_pair)
from scorer_svc.methods import SCORING_METHODS  # noqa: E402
from specdecode.executor.device import resolve_device, resolve_dtype  # noqa: E402
from specdecode.executor.model_runner import ModelRunner  # noqa: E402
from specdecode_stack.inprocess import build_inprocess_engine  # noqa: E402


@click.group()
def cli() -> None:
    """The executor on an accelerator, one question per subcommand."""


# -- gpu ---------------------------------------------------------------------------------------


def copy_bandwidth(device) -> float:
    """Bytes moved per second (read + write) by a large device copy."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start, n = time.perf_counter(), 10
    for _ in range(n):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * n / (time.perf_counter() - start)


def engine_tps(target, draft, scoring, k, prompts, max_tokens, device, eager, buckets) -> dict:
    """Tokens/s and acceptance of one batch, after a warm-up request (allocator, caches)."""
    engine = build_inprocess_engine(target, draft, scoring, k, device, enforce_eager=eager,
                                    compile_batch_sizes=buckets)
    run_engine(engine, prompts[:1], max_tokens, device, tag="warm")
    r = run_engine(engine, prompts, max_tokens, device)
    return {"tokens_per_s": r["tokens_per_s"], "acceptance": r["acceptance"]}


def hf_tps(model, prompts, max_tokens, static: bool) -> float:
    """HF `generate`'s tokens/s, after a warm-up (and compilation, for a static cache)."""
    kw = {"cache_implementation": "static"} if static else {}
    hf_generate_batch(model, prompts, max_tokens, **kw)
    outputs, seconds = hf_generate_batch(model, prompts, max_tokens, **kw)
    return sum(map(len, outputs)) / seconds


def s_star(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.'s expected speed-up at acceptance alpha and draft/target cost c."""
    if alpha >= 1:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def speculation_rows(target, draft, prompts, batch_sizes, k, max_tokens, dev, eager,
                     buckets) -> list[dict]:
    """Target-only per batch, then (B <= 8) draft = target and the smaller draft, both scorers."""
    run = lambda d, scoring, kk, B: engine_tps(target, d, scoring, kk, prompts[:B], max_tokens,  # noqa: E731
                                               dev, eager, buckets)
    rows, base = [], {}
    for B in batch_sizes:
        rows.append({"what": "target-only", "B": B, **run(target, "multi-query", 0, B)})
        base[B] = rows[-1]["tokens_per_s"]
    for B in [b for b in batch_sizes if b <= 8]:
        for name, d in (("draft = target", target), ("0.5B-shaped draft", draft)):
            for scoring in ("multi-query", "batch-expansion"):
                r = run(d, scoring, k, B)
                rows.append({"what": f"{name}, {scoring}, k={k}", "B": B, **r,
                             "vs_target_only": r["tokens_per_s"] / base[B]})
    return rows


def hf_rows(res: dict, target, prompt, max_tokens: int, base: float) -> list[dict]:
    """HF `generate` at B=1, eager and with a static cache (an error noted, not raised: a
    library path that may not run on a device)."""
    rows = []
    for static in (False, True):
        try:
            tps = hf_tps(target, [prompt], max_tokens, static)
        except Exception as exc:  # noqa: BLE001
            tps, res[f"hf_{'static' if static else 'eager'}_error"] = float("nan"), repr(exc)
        rows.append({"what": f"HF generate, {'static cache' if static else 'eager'}", "B": 1,
                     "tokens_per_s": tps, "vs_target_only": tps / base})
    return rows


def forward_costs(res: dict, target, draft, prompt, k, dev, eager, buckets) -> float:
    """Decode and k+1 verify ms at B=1, and the draft/target cost ratio c of a decode."""
    runners = [ModelRunner(m, dev, enforce_eager=eager, compile_batch_sizes=buckets)
               for m in (target, draft)]
    ms = lambda runner, q: statistics.median(  # noqa: E731
        [forward_ms(runner, [prompt], q, r, dev) for r in range(6)][1:])
    decode, verify = ms(runners[0], 1), ms(runners[0], k + 1)
    c = ms(runners[1], 1) / decode
    res.update(decode_ms_B1=decode, verify_ms_B1=verify, verify_over_decode=verify / decode,
               draft_target_cost_ratio=c)
    return c


@cli.command()
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--small", is_flag=True, help="Small shapes (a dry run on CPU).")
@click.option("--prompt-len", default=128, show_default=True)
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--batches", default="1,8,32", show_default=True)
@click.option("--k", default=4, show_default=True)
@click.option("--enforce-eager", is_flag=True)
@click.option("--buckets", default=None, help="Batch sizes to compile (default: the runner's).")
@click.option("--out", default=str(RESULTS / "gpu_bench.json"), show_default=True)
def gpu(device, dtype, small, prompt_len, max_tokens, batches, k, enforce_eager, buckets, out) -> None:
    """The executor in one run: bandwidth limit, target-only tokens/s by batch, speculation
    (draft = target, and a smaller draft; both scorers), HF `generate` eager and with a
    static cache, verify-vs-decode cost, and efficiency against Leviathan et al.'s S*.
    Models are random (no download): a Qwen2-1.5B-shaped target and a Qwen2-0.5B-shaped
    draft (--small shrinks both). With draft = target every proposal is accepted (the
    ceiling); a random draft is accepted about never (pure overhead). S* = (1 - a^(k+1)) /
    ((1 - a)(k c + 1)), a the run's acceptance, c the draft/target cost of a B=1 decode
    step; efficiency = measured speed-up / S*."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    suffix, sizes = "-small" * small, [int(b) for b in batches.split(",")]
    target, draft = (random_qwen2(n + suffix, dev, dt, seed=s) for n, s in (("target", 1), ("draft", 2)))
    buckets = tuple(int(b) for b in buckets.split(",")) if buckets else None
    prompts = torch.randint(0, target.config.vocab_size, (max(sizes), prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    res: dict = {"device": str(dev), "dtype": dtype, "small": small, "k": k, "enforce_eager": enforce_eager,
                 "prompt_len": prompt_len, "max_tokens": max_tokens}
    bw = copy_bandwidth(dev)
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    res.update(copy_bandwidth_GBps=bw / 1e9, bandwidth_limit_tokens_per_s_B1=bw / 2 / weights)
    rows = speculation_rows(target, draft, prompts, sizes, k, max_tokens, dev, enforce_eager, buckets)
    base = {r["B"]: r["tokens_per_s"] for r in rows if r["what"] == "target-only"}
    rows += hf_rows(res, target, prompts[0], max_tokens, base[sizes[0]])
    c = forward_costs(res, target, draft, prompts[0], k, dev, enforce_eager, buckets)
    res["target_only_B1_fraction_of_limit"] = base[sizes[0]] / res["bandwidth_limit_tokens_per_s_B1"]
    if len(sizes) > 1:
        res["B_max_over_B1"] = base[sizes[-1]] / base[sizes[0]]
    for row in rows:
        if row.get("acceptance") is not None and "vs_target_only" in row:
            row["s_star"] = s_star(row["acceptance"], k, 1.0 if row["what"].startswith("draft = target") else c)
            row["efficiency_vs_s_star"] = row["vs_target_only"] / row["s_star"]
    show(f"gpu on {dev} ({dtype}{', small shapes' if small else ''}{', eager' if enforce_eager else ''}): "
         f"{prompt_len}-token prompts, {max_tokens} new tokens",
         ("what", "B", "tokens/s", "vs target-only", "acceptance", "S*", "eff. vs S*"),
         [(r["what"], r["B"], f"{r['tokens_per_s']:.1f}", fmt(r.get("vs_target_only")),
           fmt(r.get("acceptance")), fmt(r.get("s_star")), fmt(r.get("efficiency_vs_s_star")))
          for r in rows], width=150)
    print(res)
    save(out, **res, rows=rows)


# -- check -------------------------------------------------------------------------------------

PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], [7, 8, 9, 7, 8, 9, 7, 8]]


@torch.inference_mode()
def reference(model, prompt, n, device):
    """n greedy tokens by the model's own forward, recomputing everything each token."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model(torch.tensor([tokens], device=device)).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@cli.command()
@click.option("--device", default="auto", show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--buckets", default="1,2,4,8,16,32", show_default=True,
              help="Batch sizes the compiled forwards are compiled for.")
@click.option("--configs", default=None,
              help="proposer:scoring:k,... (proposer none|draft|self|ngram); default: all.")
@click.option("--out", default=str(RESULTS / "device_check.json"), show_default=True)
def check(device, max_tokens, dtype, buckets, configs, out) -> None:
    """Losslessness on a device: greedy spec-decode output equals the target's own greedy
    decoding (full recomputation, same dtype) for every proposer and both scorers, through
    the compiled forwards (at --buckets) and the eager ones; the table says which path each
    run took and how many forwards went through a compiled graph. Exits 1 on a mismatch."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    target, draft = (m.to(dev, dt) for m in tiny_pair())
    want = [reference(target, p, max_tokens, dev) for p in PROMPTS]
    proposers = {"none": "ngram", "draft": draft, "self": target, "ngram": "ngram"}
    runs = [("none", "multi-query", 0)] + [(name, scoring, k) for name in ("draft", "self", "ngram")
                                           for scoring in SCORING_METHODS for k in (1, 4)]
    if configs:
        runs = [(name, scoring, int(k)) for name, scoring, k in (c.split(":") for c in configs.split(","))]
    rows = []
    for (name, scoring, k), eager in ((run, eager) for run in runs for eager in (False, True)):
        engine = build_inprocess_engine(target, proposers[name], scoring, k, dev, enforce_eager=eager,
                                        compile_batch_sizes=tuple(int(b) for b in buckets.split(",")))
        compiled = engine.scorer.worker.runner.compiled
        r = run_engine(engine, PROMPTS, max_tokens, dev)
        rows.append({"proposer": name, "scoring": scoring, "k": k,
                     "mode": "compiled" if compiled else "eager",
                     "compiled_forwards": compiled.stats.runs if compiled else 0,
                     "equal": r["outputs"] == want, "acceptance": r["acceptance"]})
    show(f"greedy equality on {dev}, {dtype}",
         ("proposer", "scorer", "k", "mode", "compiled forwards", "equal", "acceptance"),
         [(r["proposer"], r["scoring"], r["k"], r["mode"], r["compiled_forwards"],
           "yes" if r["equal"] else "NO", fmt(r["acceptance"])) for r in rows], width=120)
    save(out, device=str(dev), dtype=dtype, rows=rows)
    sys.exit(0 if all(r["equal"] for r in rows) else 1)


if __name__ == "__main__":
    cli()
