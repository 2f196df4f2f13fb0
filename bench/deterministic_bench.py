"""The deterministic mode through the stack: is every greedy output the target-only batch-1
output, and what does the mode cost? Qwen2.5-Coder 0.5B drafting for 1.5B, mixed prompts
(code, prose, Q&A, copy; adaptive_bench's set).

    python bench/deterministic_bench.py [--modes on,off] [--scorings multi-query,batch-expansion]

Per mode and scoring method, one stack (three processes on loopback, the defaults otherwise:
adaptive k up to 8, the pruned draft head, early stop). Its reference is its own target-only
output at batch 1: every prompt alone with num_speculative_tokens=0. Then the defaults alone,
and the defaults and k=0 with 4 and 8 streams in flight (a pool over the prompts). Columns:
tokens/s (batch 1: all tokens over the time of all prompts one after the other; streams: over
the wall time), prompts whose whole output equals the reference, acceptance, and the on/off
ratio of tokens/s for the same path. Modes alternate per scoring method, so drift on a
shared machine falls on both. JSON: bench/results/deterministic_<pair>_<dtype>.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from adaptive_bench import PROMPTS, pair_dirs, stack_generate  # noqa: E402

from specdecode_stack.local import LocalStack, StackConfig  # noqa: E402


def run_stack(target_dir, draft_dir, dtype: str, scoring: str, mode: str,
              prompts: list[list[int]], max_tokens: int, streams: list[int]) -> list[dict]:
    """Rows (path, streams, tokens/s, outputs) of one stack, its reference first."""
    config = StackConfig(target_model=str(target_dir), draft_model=str(draft_dir),
                         tokenizer="none", device="cpu", dtype=dtype, scoring=scoring,
                         deterministic=mode, port=0)
    rows = []
    with LocalStack(config) as stack:
        for path, k, n in [("target-only", 0, 1), ("defaults", None, 1),
                           *((p, k, n) for n in streams if n > 1
                             for p, k in (("defaults", None), ("k=0", 0)))]:
            outs, wall, _ = stack_generate(stack, prompts, max_tokens, k, n)
            seconds = wall if n > 1 else sum(o.seconds for o in outs)
            draft = sum(o.draft for o in outs)
            rows.append({"mode": mode, "scoring": scoring, "path": path, "streams": n,
                         "tokens": sum(o.tokens for o in outs), "seconds": seconds,
                         "tokens_per_s": sum(o.tokens for o in outs) / seconds,
                         "acceptance": sum(o.accepted for o in outs) / draft if draft else None,
                         "outputs": [o.token_ids for o in outs]})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "outputs"}), flush=True)
    reference = rows[0]["outputs"]
    for row in rows:
        row["equal"] = sum(o == r for o, r in zip(row["outputs"], reference))
    return rows


def report(rows: list[dict], prompts: int, title: str) -> Table:
    table = Table(title=title)
    for col in ("scoring", "path", "streams", "mode", "tokens/s", "on/off",
                f"equal to target-only b1 (of {prompts})", "acceptance"):
        table.add_column(col)
    by = {(r["scoring"], r["path"], r["streams"], r["mode"]): r for r in rows}
    for r in rows:
        off = by.get((r["scoring"], r["path"], r["streams"], "off"))
        ratio = f"{r['tokens_per_s'] / off['tokens_per_s']:.2f}x" if off and r["mode"] == "on" else ""
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        table.add_row(r["scoring"], r["path"], str(r["streams"]), r["mode"],
                      f"{r['tokens_per_s']:.2f}", ratio, str(r["equal"]), acc)
    return table


@click.command()
@click.option("--pair", default="qwen", type=click.Choice(["qwen", "tiny"]), show_default=True,
              help="tiny: random test models, to check this script in seconds.")
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--modes", default="on,off", show_default=True)
@click.option("--scorings", default="multi-query,batch-expansion", show_default=True)
@click.option("--streams", default="1,4,8", show_default=True)
@click.option("--classes", default=",".join(PROMPTS), show_default=True)
@click.option("--per-class", default=2, show_default=True, help="Prompts per class.")
@click.option("--max-tokens", default=48, show_default=True)
@click.option("--results", default="bench/results", show_default=True,
              type=click.Path(path_type=Path))
def main(pair, dtype, modes, scorings, streams, classes, per_class, max_tokens, results) -> None:
    target_dir, draft_dir, encode = pair_dirs(pair)
    prompts = [encode(p) for c in classes.split(",") for p in PROMPTS[c][:per_class]]
    streams = [int(s) for s in streams.split(",")]
    start, rows = time.perf_counter(), []
    for i, scoring in enumerate(scorings.split(",")):
        order = modes.split(",")
        for mode in order if i % 2 == 0 else order[::-1]:
            rows += run_stack(target_dir, draft_dir, dtype, scoring, mode, prompts, max_tokens,
                              streams)
    minutes = (time.perf_counter() - start) / 60
    Console(width=150).print(report(rows, len(prompts), f"{pair} {dtype}, {len(prompts)} prompts "
                                    f"x {max_tokens} tokens, one run of {minutes:.1f} min"))
    results.mkdir(parents=True, exist_ok=True)
    (results / f"deterministic_{pair}_{dtype}.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
