"""Compiled forwards against eager ones, same model, same run: decode (1 new token per row) and
5-token verify times at batch 1 and 4, greedy tokens of both paths, compile time and
recompilations (docs/benchmarks.md, *Compiled forwards*).

    python bench/compiled_forwards.py --models smollm2:float32,qwen1.5b:bfloat16
    python bench/compiled_forwards.py --models tiny:float32 --max-tokens 4 --repeats 2   # CI size

Models: `smollm2` (the default SmolLM2-135M), `qwen1.5b` (the real Qwen2.5-Coder-1.5B,
specdecode.models.model_packages.fetch), `tiny` (a random 2-layer Llama). Prompts are `--prompt-len`
seeded random ids; eager and compiled calls alternate, so drift of the machine hits both.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.tiny_models import TinyModelSpec, build_tiny_model  # noqa: E402
from specdecode.executor.device import resolve_dtype  # noqa: E402
from specdecode.executor.model_runner import ModelRunner, RunnerRow  # noqa: E402

CPU = torch.device("cpu")


def load(name: str, dtype: torch.dtype):
    if name == "tiny":
        return build_tiny_model(TinyModelSpec(seed=1)).to(dtype)
    from specdecode.models.model_packages import fetch  # noqa: PLC0415 (downloads once)
    from specdecode.models.checkpoints import load_model  # noqa: PLC0415
    return load_model(fetch("qwen2.5-coder-1.5b") if name == "qwen1.5b" else None, CPU, dtype)


def greedy(runner: ModelRunner, prompts: list[list[int]], n: int, first_id: int) -> list[list[int]]:
    """n greedy tokens per prompt, the rows decoded together (cache ids first_id...): the
    first call prefills (eager), the others decode (compiled, when the runner compiles)."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        rows = [RunnerRow(first_id + i, s, 1) for i, s in enumerate(seqs)]
        for s, logits in zip(seqs, runner.forward(rows)):
            s.append(int(logits[-1].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def timed_ms(runner: ModelRunner, prompts: list[list[int]], q: int, r: int, first_id: int) -> float:
    """One forward of B rows with q new tokens each on a warm cache (their prompts)."""
    runner.forward([RunnerRow(first_id + i, p, 1) for i, p in enumerate(prompts)])
    rows = [RunnerRow(first_id + i, p + [(7 * r + j + i) % 100 for j in range(q)], q)
            for i, p in enumerate(prompts)]
    start = time.perf_counter()
    runner.forward(rows)
    return (time.perf_counter() - start) * 1000


def measure(name: str, dtype: str, batches: list[int], attention: str, prompt_len: int,
            max_tokens: int, repeats: int) -> dict:
    model = load(name, resolve_dtype(dtype))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, min(vocab, 30000), (max(batches), prompt_len), generator=gen).tolist()
    eager = ModelRunner(model, CPU, enforce_eager=True, max_num_seqs=2 * max(batches))
    start = time.perf_counter()
    compiled = ModelRunner(model, CPU, enforce_eager=False, max_num_seqs=2 * max(batches),
                           static_attention=attention, compile_batch_sizes=tuple(batches))
    result = {"model": name, "dtype": dtype, "attention": attention, "prompt_len": prompt_len,
              "startup_s": time.perf_counter() - start,
              "compile_s": compiled.compiled.stats.seconds, "rows": []}
    with torch.inference_mode():
        for B in batches:
            want = greedy(eager, prompts[:B], max_tokens, 100)
            got = greedy(compiled, prompts[:B], max_tokens, 100)
            for q in (1, 5):
                times = {"eager": [], "compiled": []}
                for r in range(repeats + 1):
                    for path, runner in (("eager", eager), ("compiled", compiled)):
                        ms = timed_ms(runner, prompts[:B], q, r, 200)
                        if r:  # the first call of each shape warms caches
                            times[path].append(ms)
                e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
                result["rows"].append({"B": B, "q": q, "eager_ms": e, "compiled_ms": c,
                                       "speedup": e / c, "greedy_equal": want == got,
                                       "greedy_tokens": max_tokens})
    result["recompiles"] = compiled.compiled.stats.recompiles
    result["compiled_runs"] = compiled.compiled.stats.runs
    return result


@click.command()
@click.option("--models", default="smollm2:float32,qwen1.5b:bfloat16", show_default=True)
@click.option("--batches", default="1,4", show_default=True)
@click.option("--attention", default="flex", show_default=True,
              help="Compiled attention backend(s), comma-separated: flex, sdpa-padded.")
@click.option("--prompt-len", default=128, show_default=True)
@click.option("--max-tokens", default=16, show_default=True, help="Greedy tokens compared.")
@click.option("--repeats", default=10, show_default=True)
@click.option("--out", default="bench/results/compiled_forwards.json", show_default=True)
def main(models, batches, attention, prompt_len, max_tokens, repeats, out) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    batch_sizes = [int(b) for b in batches.split(",")]
    results = [measure(*m.split(":"), batch_sizes, a, prompt_len, max_tokens, repeats)
               for m in models.split(",") for a in attention.split(",")]
    table = Table(title=f"compiled vs eager forwards on CPU ({torch.get_num_threads()} threads, "
                        f"{prompt_len}-token rows)")
    for col in ("model", "attention", "B", "q", "eager ms", "compiled ms", "speed-up",
                "greedy equal", "compile s", "recompiles"):
        table.add_column(col)
    for res in results:
        for row in res["rows"]:
            table.add_row(f"{res['model']} {res['dtype']}", res["attention"], str(row["B"]),
                          str(row["q"]), f"{row['eager_ms']:.1f}", f"{row['compiled_ms']:.1f}",
                          f"{row['speedup']:.2f}", "yes" if row["greedy_equal"] else "NO",
                          f"{res['compile_s']:.0f}", str(res["recompiles"]))
    Console(width=150).print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"threads": torch.get_num_threads(), "results": results},
                                    indent=2))
    sys.exit(0 if all(r["greedy_equal"] for res in results for r in res["rows"]) else 1)


if __name__ == "__main__":
    main()
