"""Restarts of a served model: how soon a scorer serves, and (`--compile on`) serves
compiled, with its caches empty (the first start) and warm (each restart).

    python bench/compile_bench.py restart --pair qwen --dtype bfloat16 --starts 2
    python bench/compile_bench.py restart --pair qwen --dtype bfloat16 --compile off
    python bench/compile_bench.py restart --pair tiny        (seconds: a smoke run)

Each start is `specdecode serve scorer --compile on|off --compile-cache DIR --cost-cache DIR2
--max-num-seqs 1 --deterministic off` (batch bucket 1: the decode graph and the 5-query
verify graph) as its own process (`--no-cost-cache`: without the second); the times are from
spawning it: serving (gRPC health SERVING: it serves eagerly from then on), the decode graph
ready (every decode after it runs compiled), every graph ready, read from the scorer's
/metrics (`specdecode_model_compiled_graphs`) every 0.2 s, with the graphs the cache held
(`specdecode_model_compile_cache_hits`) and whether the forward-cost table was the kept one
(its log). What a compiled forward costs against an eager one: `bench/executor_bench.py
compiled`.
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


def start_once(model: Path, dtype: str, compile_mode: str, cache: Path, costs: Path | None,
               log: Path, timeout_s: float) -> dict:
    """One scorer start on `cache` (and `costs`): seconds from its spawn to serving, to its
    decode graph and to every graph ready (none with compile off), the graphs reloaded from
    the cache, and whether its forward-cost table was the kept one."""
    port, metrics = free_port(), free_port()
    cmd = [sys.executable, "-m", "specdecode_stack.cli", "serve", "scorer", "--model",
           str(model), "--device", "cpu", "--dtype", dtype, "--deterministic", "off",
           "--compile", compile_mode, "--compile-cache", str(cache),
           *(["--cost-cache", str(costs)] if costs else []), "--max-num-seqs", "1",
           "--scoring", "multi-query", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", str(metrics), "--log-format", "text"]
    begin = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_process_serving(f"127.0.0.1:{port}", timeout_s, process, log=log)
        result = {"serving_s": time.monotonic() - begin, "decode_graph_s": None,
                  "table_kept": "forward costs from" in log.read_text()}
        if compile_mode == "off":
            return {**result, "all_graphs_s": None, "cache_hits": 0.0}
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
@click.option("--compile", "compile_mode", default="on", show_default=True,
              type=click.Choice(["on", "off"]))
@click.option("--cost-cache/--no-cost-cache", default=True, show_default=True,
              help="Keep the forward-cost table across the starts (--cost-cache).")
@click.option("--timeout", "timeout_s", default=3600.0, show_default=True)
@click.option("--out", default=str(RESULTS / "compile_restart.json"), show_default=True)
def restart(pair, dtype, starts, compile_mode, cost_cache, timeout_s, out) -> None:
    """A scorer started `--starts` times on one compile cache (and cost cache): when it
    serves, when its decode graph and all its graphs are ready, how many came from the
    cache, whether its cost table was the kept one."""
    model = pair_dirs(pair)[0]
    work = Path(tempfile.mkdtemp(prefix="compile-bench-"))
    costs = work / "costs" if cost_cache else None
    rows = [{"start": i + 1, **start_once(model, dtype, compile_mode, work / "cache", costs,
                                         work / f"scorer{i}.log", timeout_s)}
            for i in range(starts)]
    graphs = GRAPHS if compile_mode == "on" else 0
    show(f"scorer restarts ({pair}, {dtype}, --compile {compile_mode}, {graphs} graphs, "
         f"cost table {'kept' if cost_cache else 'not kept'}), seconds from spawning it",
         ("start", "serving", "decode graph ready", "all graphs ready", "reloaded from the cache",
          "cost table kept"),
         [(r["start"], fmt(r["serving_s"], ".1f"), fmt(r["decode_graph_s"], ".1f"),
           fmt(r["all_graphs_s"], ".1f"), f"{r['cache_hits']:.0f} / {graphs}",
           "yes" if r["table_kept"] else "no") for r in rows])
    save(out, pair=pair, dtype=dtype, compile=compile_mode, cost_cache=cost_cache,
         graphs=graphs, rows=rows)


if __name__ == "__main__":
    cli()
