"""Attention over the KV pool, backend by backend, on one device: today's per-row SDPA (eager,
on pool views), padded SDPA (eager and compiled) and FlexAttention (compiled) at decode and
5-token verify shapes (docs/benchmarks.md, *Compiled forwards*).

    python bench/attention_backends.py                    # SmolLM2 fp32 and Qwen-1.5B bf16 shapes
    python bench/attention_backends.py --small            # CI size

Each row of the batch has `--context` cached keys in its own extent of a pool of
`--pool-tokens` slots; every backend's output is checked against per-row SDPA's. Times are
medians of `--repeats` calls of one layer's attention (compile time reported apart).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specdecode.executor.attention import AttnBatch, SdpaBackend  # noqa: E402
from specdecode.executor.static_attention import (FlexBackend, PaddedSdpaBackend, StaticRows,  # noqa: E402
                                                  causal_new_mask)

SHAPES = {  # name: (heads, kv heads, head dim, dtype)
    "smollm2-fp32": (9, 3, 64, torch.float32),
    "qwen1.5b-bf16": (12, 2, 128, torch.bfloat16),
    "tiny-fp32": (4, 2, 16, torch.float32),
}


def case(shape: str, B: int, q: int, context: int, pool_tokens: int, seed: int = 0):
    """(query [B*q, H, D], pool layer [2, Hkv, T, D], ragged batch, static rows)."""
    H, Hkv, D, dtype = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, Hkv, pool_tokens, D, generator=gen).to(dtype)
    query = torch.randn(B * q, H, D, generator=gen).to(dtype)
    extent = pool_tokens // B // 16 * 16
    starts = [b * extent for b in range(B)]
    lens = [context + q] * B
    slots = torch.tensor([s + L - q + j for s, L in zip(starts, lens) for j in range(q)])
    batch = AttnBatch([b * q for b in range(B + 1)], starts, lens, slots, None)
    rows = StaticRows(torch.tensor(starts), torch.tensor(lens) - q, causal_new_mask(B, q, "cpu"),
                      slots, torch.arange(-(-(context + q) // 16) * 16))
    return query, kv, batch, rows, D ** -0.5


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


@torch.inference_mode()
def measure(shape: str, B: int, q: int, context: int, pool_tokens: int, repeats: int) -> list[dict]:
    query, kv, batch, rows, scale = case(shape, B, q, context, pool_tokens)
    H = query.shape[1]
    per_row = SdpaBackend()
    per_row.prepare(batch, H // kv.shape[1], query.device)
    want = per_row.attend(query, kv, batch, scale).float()
    padded, flex = PaddedSdpaBackend(), FlexBackend()
    runs = {"per-row SDPA (eager)": (lambda: per_row.attend(query, kv, batch, scale), 0.0),
            "padded SDPA (eager)": (lambda: padded.attend(query, kv, rows, scale), 0.0)}
    for name, backend in (("padded SDPA (compiled)", padded), ("flex (compiled)", flex)):
        torch._dynamo.reset()
        fn = torch.compile(lambda qq, kk, rr, be=backend: be.attend(qq, kk, rr, scale),
                           fullgraph=True)
        start = time.perf_counter()
        fn(query, kv, rows)
        runs[name] = (lambda fn=fn: fn(query, kv, rows), time.perf_counter() - start)
    out = []
    for name, (fn, compile_s) in runs.items():
        err = (fn().float() - want).abs().max().item()
        out.append({"shape": shape, "B": B, "q": q, "context": context, "backend": name,
                    "ms": median_ms(fn, repeats), "compile_s": compile_s, "max_abs_diff": err})
    base = out[0]["ms"]
    for row in out:
        row["vs_per_row"] = row["ms"] / base
    return out


@click.command()
@click.option("--shapes", default="smollm2-fp32,qwen1.5b-bf16", show_default=True)
@click.option("--batches", default="1,4", show_default=True)
@click.option("--queries", default="1,5", show_default=True)
@click.option("--context", default=512, show_default=True, help="Cached keys per row.")
@click.option("--pool-tokens", default=8192, show_default=True)
@click.option("--repeats", default=50, show_default=True)
@click.option("--small", is_flag=True, help="CI size: tiny shapes, one batch, short rows.")
@click.option("--out", default="bench/results/attention_backends.json", show_default=True)
def main(shapes, batches, queries, context, pool_tokens, repeats, small, out) -> None:
    if small:
        shapes, batches, context, pool_tokens, repeats = "tiny-fp32", "2", 40, 512, 3
    torch.manual_seed(0)
    rows = [r for shape in shapes.split(",") for B in map(int, batches.split(","))
            for q in map(int, queries.split(","))
            for r in measure(shape, B, q, context, pool_tokens, repeats)]
    table = Table(title=f"one layer's attention over the KV pool ({context} cached keys per "
                        f"row, {torch.get_num_threads()} threads)")
    for col in ("shape", "B", "q", "backend", "ms", "vs per-row", "compile s", "max |diff|"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["shape"], str(r["B"]), str(r["q"]), r["backend"], f"{r['ms']:.3f}",
                      f"{r['vs_per_row']:.2f}", f"{r['compile_s']:.1f}", f"{r['max_abs_diff']:.1e}")
    Console(width=140).print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"context": context, "pool_tokens": pool_tokens,
                                     "threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
