"""Speculate only where it pays, measured through the gRPC stack: Qwen2.5-Coder 0.5B drafting
for 1.5B on a mixed prompt set (code, prose, Q&A, copy), against HF `generate`.

    python bench/adaptive_bench.py --quick [--dtypes bfloat16,float32]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/adaptive_bench.py --quick  # no bf16 units

Per dtype, in one run: HF target-only greedy, HF assisted generation (its defaults, and
constant k, best reported), then the stack (three processes on loopback) at its defaults
(adaptive k, auto scoring), at k=0 (requests with num_speculative_tokens=0: plain decoding
through the same stack), at fixed k for both scorers (the draft proposes k tokens every step:
no early stop), with the draft head the defaults do not use (whole, or pruned), and with the
n-gram proposer (defaults vs its own k=0). Batch 1 runs each prompt alone; "4 streams" runs the
four classes concurrently. Columns: tokens/s (batch 1: the median over prompts and repeats),
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

import concurrent.futures
import contextlib
import gc
import json
import math
import os
import statistics
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from specdecode.api.client import SpecDecodeClient
from specdecode_stack.local import LocalStack, StackConfig
from specdecode.models.model_packages import fetch
from specdecode.models.checkpoints import load_model, load_tokenizer, resolve_model_dir
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model

CPU = torch.device("cpu")


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = {
    "code": ["def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
             "def binary_search(items, target):\n    \"\"\"Index of target in the sorted list "
             "items, or -1.\"\"\"\n"],
    "class": ["class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
              "class Point:\n    \"\"\"A point in the plane.\"\"\"\n\n    def __init__(self, x, y):\n"],
    "prose": ["The history of the printing press begins in fifteenth-century Europe, where",
              "Autumn arrived early that year in the small mountain village, and"],
    "qa": [chat("Why is the sky blue? Answer in two sentences."),
           chat("What is the difference between a list and a tuple in Python?")],
    # Texts longer than the generations, so that the whole answer is a copy.
    "copy": [chat("Repeat this text exactly: The committee met on Tuesday to review the budget "
                  "for the coming year. After a long discussion, the members agreed to increase "
                  "funding for the public library, to repair the roads near the school, and to "
                  "hire two more nurses for the clinic. The chair thanked everyone for their "
                  "patience and closed the meeting at nine o'clock in the evening. The next "
                  "meeting will be held on the first Monday of March in the town hall."),
             chat("Copy this code without changes:\nfor i in range(10):\n    total += i * i\n"
                  "    if total > 100:\n        print('large', i, total)\n    else:\n"
                  "        print('small', i, total)\nresult = [x * 2 for x in values if x > 0]\n"
                  "print(sum(result), len(result), max(result))\n")],
}


@dataclass
class Outcome:
    tokens: int
    seconds: float
    token_ids: list[int]
    draft: int = 0
    accepted: int = 0
    chosen_k: float = math.nan  # mean k per sequence-step (stack, batch 1)
    predicted: float = math.nan  # the policy's mean predicted speed-up per step (stack)
    # HF target-only: the target's greedy output up to and including its first end token
    # (the whole output when it has none)
    greedy_to_eos: list[int] | None = None


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def greedy_to_eos(new: list[int], raw_logits, eos: set[int]) -> list[int]:
    """The greedy output up to and including its first end token, from a forced run's
    tokens and the logits each was chosen from before the logits processors (new[i] is
    argmax(raw_logits[i]) unless `min_new_tokens` masked an end token there)."""
    for i, logits in enumerate(raw_logits):
        top = int(logits[0].argmax())
        if top in eos:
            return new[:i] + [top]
    return new


def hf_generate(target, ids: list[int], max_tokens: int, reference: bool = False, **kw) -> Outcome:
    """max_tokens tokens (min_new_tokens holds generation past an end token, so every path
    times the same count); reference: also read the greedy output to its first end token."""
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                              output_logits=reference, **kw)
    seconds = time.perf_counter() - start
    new = out.sequences[0, len(ids):].tolist()
    return Outcome(len(new), seconds, new,
                   greedy_to_eos=greedy_to_eos(new, out.logits, eos_ids(target)) if reference else None)


def metric_total(port: int, name: str, **labels: str) -> float:
    """The sum of a metric's samples on a /metrics page whose labels include `labels`."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", body, re.M):
        if all(f'{k}="{v}"' in (m[1] or "") for k, v in labels.items()):
            total += float(m[2])
    return total


def scrape(port: int) -> tuple[float, float, float, float]:
    """(sum, count) of the orchestrator's specdecode_chosen_k histogram, then of its
    specdecode_predicted_speedup (per step)."""
    return tuple(metric_total(port, f"specdecode_{name}_{part}")
                 for name in ("chosen_k", "predicted_speedup") for part in ("sum", "count"))


def stack_generate(stack: LocalStack, prompts: list[list[int]], max_tokens: int,
                   k: int | None, streams: int) -> tuple[list[Outcome], float, float]:
    """Outcomes per prompt, wall seconds for all, and (streams > 1) the mean chosen k per
    sequence-step over all of them."""
    def one(ids):
        with SpecDecodeClient(stack.address, timeout_s=3600) as client:
            start = time.perf_counter()
            r = client.generate(ids, max_tokens=max_tokens, num_speculative_tokens=k)
            u = r.usage
            return Outcome(len(r.token_ids), time.perf_counter() - start, r.token_ids,
                           u.draft_tokens, u.accepted_tokens)
    def mean(before, after, at: int = 0) -> float:  # at 0: chosen k, 2: predicted speed-up
        n = after[at + 1] - before[at + 1]
        return (after[at] - before[at]) / n if n > 0 else math.nan
    port = stack.metrics_ports["orchestrator"]
    start = time.perf_counter()
    if streams == 1:  # one at a time, each with its own mean chosen k
        outs = []
        for p in prompts:
            before = scrape(port)
            outs.append(one(p))
            after = scrape(port)
            outs[-1].chosen_k, outs[-1].predicted = mean(before, after), mean(before, after, 2)
        return outs, time.perf_counter() - start, math.nan
    before = scrape(port)
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        outs = list(pool.map(one, prompts))
    after = scrape(port)
    for o in outs:
        o.predicted = mean(before, after, 2)
    return outs, time.perf_counter() - start, mean(before, after)


def paired(stack: LocalStack, prompts: list[list[int]], max_tokens: int, repeats: int,
           a: int | None, b: int | None, record: Callable[[int | None, int, Outcome], None]) -> None:
    """Each prompt `repeats` times at k=a and at k=b, alternating which goes first (A B, B A,
    ...), prompt by prompt; record(k, prompt index, outcome) after each run."""
    for j, p in enumerate(prompts):
        for r in range(repeats):
            for k in ((a, b) if r % 2 == 0 else (b, a)):
                record(k, j, stack_generate(stack, [p], max_tokens, k, 1)[0][0])


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


def pair_dirs(pair: str) -> tuple[Path, Path, Callable[[str], list[int]]]:
    """(target dir, draft dir, text -> prompt ids) of the Qwen pair, or of tiny random test
    models (a smoke test of a script: prompts as byte ids)."""
    if pair == "tiny":
        tmp = Path(tempfile.mkdtemp())
        target_dir, draft_dir = tmp / "target", tmp / "draft"
        encode = lambda text: [b % 256 for b in text.encode()][-48:]  # noqa: E731
        target = build_tiny_model(TinyModelSpec(seed=1))
        # An end token that the Q&A prompt's greedy output reaches within 4 tokens, as the
        # real pair's chat answer reaches <|im_end|>: the equality to EOS is exercised.
        with torch.inference_mode():
            out = target.generate(torch.tensor([encode(PROMPTS["qa"][0])]), max_new_tokens=4,
                                  do_sample=False, pad_token_id=0)
        target.generation_config.eos_token_id = int(out[0, -1])
        target.save_pretrained(target_dir)
        build_tiny_model(TinyModelSpec(seed=2, num_layers=1)).save_pretrained(draft_dir)
        return target_dir, draft_dir, encode
    draft_dir = resolve_model_dir(fetch("qwen2.5-coder-0.5b"))
    target_dir = resolve_model_dir(fetch("qwen2.5-coder-1.5b"))
    tokenizer = load_tokenizer(target_dir)
    return target_dir, draft_dir, lambda text: tokenizer(text).input_ids


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
@click.option("--be-k", default=None, help="Fixed k for batch expansion [2,4,8; --quick: 4].")
@click.option("--hf-k", default=None, help="HF assisted constant k [2,4,8; --quick: 4].")
@click.option("--draft-vocab", default=0 if StackConfig.draft_vocab_size else 32768,
              show_default=True, help="The `pruned` part's draft head: the one the defaults do "
              "not use (0 = the whole vocabulary).")
@click.option("--ngram-k-max", default=str(StackConfig.num_speculative_tokens), show_default=True,
              help="The n-gram stack's --num-speculative-tokens (the most the policy picks), "
                   "one server per value.")
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
                   "head (--draft-vocab); fixed: fixed k, both scorers; ngram: the n-gram proposer at defaults "
                   "and at k=0; busy: the defaults on a stack started while busy loops held "
                   "every core, run --busy-wait seconds after the load ended.")
def main(dtypes, quick, max_tokens, repeats, classes, fixed_k, be_k, hf_k, draft_vocab,
         ngram_k_max, busy_wait, parts, results, pair) -> None:
    parts = set(parts.split(","))
    ngram_k_max = [int(x) for x in ngram_k_max.split(",")]
    per_class = 1 if quick else 2
    if max_tokens is None:
        max_tokens = 16 if quick else 32
    be_k, hf_k = (x or ("4" if quick else "2,4,8") for x in (be_k, hf_k))
    fixed, be_ks, hf_ks = ([int(x) for x in s.split(",") if x] for s in (fixed_k, be_k, hf_k))
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    console = Console(width=170)
    target_dir, draft_dir, encode = pair_dirs(pair)
    classes = [(c, encode(p)) for c in classes.split(",") for p in PROMPTS[c][:per_class]]
    prompts = [ids for _, ids in classes]
    for dtype in dtypes.split(","):
        torch_dtype = getattr(torch, dtype)
        rows = []  # one per (path, streams, class, run)
        t_start = time.perf_counter()

        log = results / f"adaptive_{pair}_{dtype}_{isa}.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)

        def add(path, outs, chosen=float("nan"), wall=None, streams=1, start=0):
            # Each run is also printed and appended at once: a run cut short keeps its rows.
            # outs: outcomes of the prompts from `start` on.
            for j, ((cls, _), o) in enumerate(zip(classes[start:], outs), start):
                row = {"path": path, "streams": streams, "class": cls, "prompt": j, "tokens": o.tokens,
                       "seconds": o.seconds, "draft": o.draft, "accepted": o.accepted,
                       "chosen_k": o.chosen_k if streams == 1 else chosen,
                       "predicted": o.predicted,
                       "token_ids": o.token_ids, "greedy_to_eos": o.greedy_to_eos}
                line = {k: v for k, v in row.items()
                        if k not in ("token_ids", "prompt", "greedy_to_eos")}
                line["tokens_per_s"] = o.tokens / o.seconds
                console.print(json.dumps(line), highlight=False)
                with log.open("a") as f:
                    f.write(json.dumps(line) + "\n")
                rows.append(row)
            if wall is not None:
                rows.append({"path": path, "class": "all", "streams": streams, "seconds": wall,
                             "tokens": sum(o.tokens for o in outs), "draft": sum(o.draft for o in outs),
                             "accepted": sum(o.accepted for o in outs), "chosen_k": chosen,
                             "predicted": outs[0].predicted if outs else math.nan,
                             "token_ids": None})

        def add_paired(label_a, label_b, stack, a, b):
            """Each run's row as soon as it ran (a run cut short keeps the pairs it did)."""
            paired(stack, prompts, max_tokens, repeats, a, b,
                   lambda k, j, o: add(label_a if k == a else label_b, [o], start=j))

        if parts & {"ref", "hf"}:
            target = load_model(target_dir, CPU, torch_dtype)
            if "ref" in parts:
                add("HF target-only", [hf_generate(target, ids, max_tokens, reference=True)
                                       for ids in prompts])
            if "hf" in parts:
                draft = load_model(draft_dir, CPU, torch_dtype)
                add("HF assisted, defaults", [hf_generate(target, ids, max_tokens,
                                                          assistant_model=draft)
                                              for ids in prompts])
                for k in hf_ks:
                    draft.generation_config.num_assistant_tokens = k
                    draft.generation_config.num_assistant_tokens_schedule = "constant"
                    add(f"HF assisted, k={k} constant", [hf_generate(target, ids, max_tokens,
                                                                     assistant_model=draft)
                                                         for ids in prompts])
                add("HF prompt lookup", [hf_generate(target, ids, max_tokens,
                                                     prompt_lookup_num_tokens=4)
                                         for ids in prompts])
                del draft
            del target
            gc.collect()

        def stack(**kw) -> LocalStack:
            return LocalStack(StackConfig(target_model=str(target_dir), tokenizer="none",
                                          device="cpu", dtype=dtype, port=0, **kw))
        draft_path = str(draft_dir)
        if parts & {"defaults", "streams"}:
            with stack(draft_model=draft_path) as s:  # adaptive k, auto scoring
                if "defaults" in parts:
                    add_paired("stack defaults", "stack k=0", s, None, 0)
                both = (("stack defaults", None), ("stack k=0", 0))
                for r in range(repeats if "streams" in parts else 0):  # A B, B A, ...
                    for label, k in both if r % 2 == 0 else both[::-1]:
                        outs, wall, chosen = stack_generate(s, prompts, max_tokens, k, len(prompts))
                        add(label, outs, chosen, wall, streams=len(prompts))
        if "busy" in parts:  # started while busy loops hold every core, then left alone
            s = stack(draft_model=draft_path)
            with busy_loops():
                s.start()
            with s:
                console.print(f"load ended; left alone for {busy_wait:.0f} s", highlight=False)
                time.sleep(busy_wait)
                outs, _, chosen = stack_generate(s, prompts, max_tokens, None, 1)
                add(f"stack defaults, started under load, {busy_wait:.0f} s after", outs, chosen)
        if "pruned" in parts:
            with stack(draft_model=draft_path, draft_vocab_size=draft_vocab) as s:
                outs, _, chosen = stack_generate(s, prompts, max_tokens, None, 1)
                add("stack defaults, whole draft head" if draft_vocab == 0
                    else f"stack defaults, draft head {draft_vocab}", outs, chosen)
        for scoring, ks in (("multi-query", fixed), ("batch-expansion", be_ks)):
            if "fixed" not in parts or not ks:
                continue
            with stack(draft_model=draft_path, scoring=scoring, speculation="fixed",
                       num_speculative_tokens=max(ks), draft_confidence=0.0) as s:
                for k in ks:
                    outs, _, chosen = stack_generate(s, prompts, max_tokens, k, 1)
                    add(f"stack fixed k={k}, {scoring}", outs, chosen)
                if scoring == "multi-query" and "streams" in parts:
                    outs, wall, chosen = stack_generate(s, prompts, max_tokens, 4, len(prompts))
                    add("stack fixed k=4, multi-query", outs, chosen, wall, streams=len(prompts))
        if "ngram" in parts:
            for k_max in ngram_k_max:
                with stack(draft_model="ngram", num_speculative_tokens=k_max) as s:
                    label = "" if k_max == StackConfig.num_speculative_tokens else f", k<={k_max}"
                    add_paired(f"stack n-gram defaults{label}", f"stack n-gram k=0{label}", s,
                               None, 0)
        report(console, rows, classes, dtype, isa, max_tokens, time.perf_counter() - t_start,
               pair, results)
        differences(console, rows, prompts, target_dir, torch_dtype)


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


def differences(console, rows, prompts, target_dir, torch_dtype) -> None:
    """Where an output differs from its reference (see `reference`), the target's logit gap
    between the two tokens at the first difference (one forward over the prompt and the
    reference's tokens before it, same dtype): a gap within the dtype's rounding is a
    near-tie, not a lost token."""
    firsts = {}  # (prompt, index, reference to it) -> [(path, class, token there)]
    refs_of = {}
    for r in rows:
        if r.get("token_ids") is None:
            continue
        refs = refs_of.setdefault(r["path"], reference(rows, r["path"])[0])
        ref = refs.get(r["prompt"])
        if ref is None:
            continue
        i = next((i for i, (a, b) in enumerate(zip(r["token_ids"], ref)) if a != b), None)
        if i is None:  # equal as far as both go (a stop token, or a reference ending at EOS)
            continue
        firsts.setdefault((r["prompt"], i, tuple(ref[:i + 1])), []).append(
            (r["path"], r["class"], r["token_ids"][i]))
    if not firsts:
        return
    target = load_model(target_dir, CPU, torch_dtype)
    for (j, i, ref), seen in sorted(firsts.items()):
        with torch.inference_mode():
            logits = target(torch.tensor([prompts[j] + list(ref[:i])])).logits[0, -1].float()
        for path, cls, token in sorted(set(seen)):
            console.print(f"{cls} (prompt {j}), {path}: first differs at token {i}: reference "
                          f"{ref[i]} (logit {logits[ref[i]]:.4f}) vs {token} (logit "
                          f"{logits[token]:.4f}), gap {logits[ref[i]] - logits[token]:.4f}; "
                          f"top logit {logits.max():.4f}", highlight=False)
    del target
    gc.collect()


def report(console, rows, classes, dtype, isa, max_tokens, seconds, pair, results) -> None:
    """One line per (path, streams, class): batch 1 the median tokens/s of its runs, 4
    streams all tokens over the wall time; equality to the reference (see `reference`;
    4 streams: each stream's output against its prompt's) and to the own k=0 path."""
    name = "Qwen2.5-Coder 0.5B -> 1.5B" if pair == "qwen" else "tiny random models"
    table = Table(title=f"{name}, CPU {dtype} (ATEN_CPU_CAPABILITY={isa}), "
                        f"{max_tokens} tokens/prompt, greedy; {seconds / 60:.1f} min")
    for col in ("path", "streams", "class", "runs", "tokens/s", "vs HF target-only",
                "vs own k=0", "predicted", "acceptance", "chosen k", "equal to reference",
                "equal to stack k=0"):
        table.add_column(col)
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["path"], r["streams"], r["class"]), []).append(r)
    tps = {key: (statistics.median(r["tokens"] / r["seconds"] for r in rs) if key[1] == 1
                 else sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs))
           for key, rs in groups.items()}
    has_ref = any(key[0] == "HF target-only" for key in groups)
    out = []
    for (path, streams, cls), rs in groups.items():
        if streams > 1 and cls != "all":
            continue
        if cls == "all":  # 4 streams: HF target-only's tokens over its seconds, one at a time
            ref = [r for r in rows if r["path"] == "HF target-only"]
            base = sum(r["tokens"] for r in ref) / sum(r["seconds"] for r in ref) if ref else None
            runs = [r for r in rows if r["path"] == path and r["streams"] == streams
                    and r["class"] != "all"]  # each stream's own output
        else:
            base = tps.get(("HF target-only", 1, cls))
            runs = rs
        own_zero = own_zero_of(path)
        zero = tps.get((own_zero, streams, cls)) if own_zero else None
        draft = sum(r["draft"] for r in rs)
        acc = sum(r["accepted"] for r in rs) / draft if draft else None
        chosen = [r["chosen_k"] for r in rs if r["chosen_k"] == r["chosen_k"]]
        chosen_k = statistics.mean(chosen) if chosen else None
        # the policy's own prediction of its speed-up over plain decoding, beside vs own k=0
        said = [r["predicted"] for r in rs if r.get("predicted", math.nan) == r.get("predicted")]
        predicted = statistics.mean(said) if said and own_zero_of(path) else None
        refs, what = reference(rows, path)
        eq = equal_tokens(runs, refs)
        # past any end token: every stack path against the stack's k=0 (the n-gram's own)
        zero_path = own_zero or ("stack k=0" if path.startswith("stack") else None)
        eq_zero = (equal_tokens(runs, first_outputs(rows, zero_path))
                   if has_ref and zero_path not in (None, path) else None)
        equal = "-" if eq is None else f"{eq[0]}/{eq[1]}" + (" to EOS" if eq[2] else "") + (
            " (own k=0)" if what == "own k=0" else "")
        row = {"path": path, "streams": streams, "class": cls, "runs": len(rs),
               "tokens_per_s": tps[(path, streams, cls)],
               "vs_hf_target_only": tps[(path, streams, cls)] / base if base else None,
               "acceptance": acc, "vs_own_k0": tps[(path, streams, cls)] / zero if zero else None,
               "chosen_k": chosen_k, "predicted_speedup": predicted, "equal": equal,
               "reference": what,
               "equal_tokens": eq and eq[0], "compared_tokens": eq and eq[1],
               "reference_ends_at_eos": eq and eq[2],
               "equal_own_k0": None if eq_zero is None else f"{eq_zero[0]}/{eq_zero[1]}"}
        out.append(row)
        table.add_row(path, str(streams), cls, str(len(rs)), f"{row['tokens_per_s']:.2f}",
                      "-" if base is None else f"{row['vs_hf_target_only']:.2f}x",
                      "-" if zero is None else f"{row['vs_own_k0']:.2f}x",
                      "-" if predicted is None else f"{predicted:.2f}x",
                      "-" if acc is None else f"{acc:.2f}",
                      "-" if chosen_k is None else f"{chosen_k:.2f}", equal,
                      row["equal_own_k0"] or "-")
    console.print(table)
    one = {c for c, _ in classes if sum(c == d for d, _ in classes) == 1}
    ends = {r["class"] if r["class"] in one else f"{r['class']} #{r['prompt']}": len(r["greedy_to_eos"])
            for r in first_rows(rows, "HF target-only")
            if r["greedy_to_eos"] is not None and len(r["greedy_to_eos"]) < r["tokens"]}
    if ends:
        console.print("The target's greedy output ends (end token included) at token "
                      + ", ".join(f"{n} ({c})" for c, n in ends.items())
                      + "; stack outputs are compared up to there, HF's (held past it by "
                      "min_new_tokens) with HF target-only's.", highlight=False)
    path = results / f"adaptive_{pair}_{dtype}_{isa}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"dtype": dtype, "isa": isa, "max_tokens": max_tokens,
                                "minutes": seconds / 60, "greedy_ends": ends, "rows": out},
                               indent=2))


if __name__ == "__main__":
    main()
