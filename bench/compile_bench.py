"""Compiled forwards in a served model: how soon a scorer started with `--compile on` serves
compiled, with its compile cache empty (the first start) and warm (each restart).

    python bench/compile_bench.py restart --pair qwen --dtype bfloat16 --starts 2
    python bench/compile_bench.py restart --pair tiny        (seconds: a smoke run)

Each start is `specdecode serve scorer --compile on --compile-cache DIR --max-num-seqs 1
--deterministic off` (batch bucket 1: the decode graph and the 5-query verify graph) as its
own process; the times are from spawning it: serving (gRPC health SERVING: it serves eagerly
from then on), the decode graph ready (every decode after it runs compiled), every graph
ready, read from the scorer's /metrics (`specdecode_model_compiled_graphs`) every 0.2 s,
with the graphs the cache held (`specdecode_model_compile_cache_hits`). What a compiled
forward costs against an eager one: `bench/executor_bench.py compiled`.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the root: bench.harness
from bench.harness import RESULTS, fmt, metric_total, pair_dirs, save, show  # noqa: E402
from specdecode_stack.local import free_port, wait_process_serving  # noqa: E402

GRAPHS = 2  # batch bucket 1 x (decode, verify at k = 4)
POLL_S = 0.2


def start_once(model: Path, dtype: str, cache: Path, log: Path, timeout_s: float) -> dict:
    """One scorer start on `cache`: seconds from its spawn to serving, to its decode graph
    and to every graph ready, and the graphs reloaded from the cache."""
    port, metrics = free_port(), free_port()
    cmd = [sys.executable, "-m", "specdecode_stack.cli", "serve", "scorer", "--model",
           str(model), "--device", "cpu", "--dtype", dtype, "--deterministic", "off",
           "--compile", "on", "--compile-cache", str(cache), "--max-num-seqs", "1",
           "--scoring", "multi-query", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", str(metrics), "--log-format", "text"]
    begin = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_process_serving(f"127.0.0.1:{port}", timeout_s, process, log=log)
        result = {"serving_s": time.monotonic() - begin, "decode_graph_s": None}
        while (graphs := metric_total(metrics, "specdecode_model_compiled_graphs")) < GRAPHS:
            if graphs >= 1 and result["decode_graph_s"] is None:
                result["decode_graph_s"] = time.monotonic() - begin
            if process.poll() is not None or time.monotonic() - begin > timeout_s:
                raise RuntimeError(f"no compiled graphs after {time.monotonic() - begin:.0f} s; "
                                   f"see {log}")
            time.sleep(POLL_S)
        result["all_graphs_s"] = time.monotonic() - begin
        result["decode_graph_s"] = result["decode_graph_s"] or result["all_graphs_s"]
        result["cache_hits"] = metric_total(metrics, "specdecode_model_compile_cache_hits_total")
        return result
    finally:
        process.terminate()
        process.wait(60)


@click.group()
def cli() -> None:
    """Compiled forwards in a served model."""


@cli.command()
@click.option("--pair", default="tiny", show_default=True,
              help="qwen (the scorer serves Qwen2.5-Coder 1.5B) or tiny (a random 2-layer Llama).")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--starts", default=2, show_default=True,
              help="Starts on one cache: the first cold, the others warm.")
@click.option("--timeout", "timeout_s", default=3600.0, show_default=True)
@click.option("--out", default=str(RESULTS / "compile_restart.json"), show_default=True)
def restart(pair, dtype, starts, timeout_s, out) -> None:
    """A scorer started `--starts` times on one compile cache: when it serves, when its
    decode graph and all its graphs are ready, how many came from the cache."""
    model = pair_dirs(pair)[0]
    work = Path(tempfile.mkdtemp(prefix="compile-bench-"))
    rows = [{"start": i + 1, **start_once(model, dtype, work / "cache", work / f"scorer{i}.log",
                                         timeout_s)} for i in range(starts)]
    show(f"scorer restarts on one compile cache ({pair}, {dtype}, --compile on, "
         f"{GRAPHS} graphs), seconds from spawning it",
         ("start", "serving", "decode graph ready", "all graphs ready", "reloaded from the cache"),
         [(r["start"], fmt(r["serving_s"], ".1f"), fmt(r["decode_graph_s"], ".1f"),
           fmt(r["all_graphs_s"], ".1f"), f"{r['cache_hits']:.0f} / {GRAPHS}") for r in rows])
    save(out, pair=pair, dtype=dtype, graphs=GRAPHS, rows=rows)


if __name__ == "__main__":
    cli()
