"""The best tokens/s any speculation length k can give on this CPU, computed from measured
forward costs: how far the stack can get, and what it would take to reach a target.

    python bench/ceiling.py --dtype bfloat16 --hf --stack draft,ngram   # native: the draft pair
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/ceiling.py --dtype bfloat16 \\
        --classes copy --widths 1-9,12,17 --overheads-from bench/results/ceiling_bfloat16_native.json
    python bench/ceiling.py --pair tiny --widths 1-5 --repeats 1 --hf --stack draft  # smoke test

Measured in this process, one model at a time (1 row, warm cache, median of --repeats after
one untimed run): the target's forward of w new tokens, V(w), for w in --widths (a decode is
V(1), a verify of k proposals V(k+1)); the draft's forward of 1 and 2 new tokens, D1 and D2,
with the whole LM head and with it pruned to --vocab ids; each class prompt's prefill by both
models. With --stack, the stack's own cost per step beyond its forwards (RPCs, sampling,
rejection sampling, bookkeeping, the time between steps): a local stack at fixed k, one
request per k in --stack-k, (request wall time - the services' forward seconds from their
metrics) / steps from the orchestrator's metrics. With --hf, HF `generate` target-only and
assisted (defaults and constant k), measured on the same prompts and --max-tokens.

The model, per k (k+1 tokens a step at acceptance 1; (1 - a^(k+1)) / (1 - a) at a):
    step(k)   = V(k+1) + O(k) + [k > 0] (D2 + (k-1) D1)      (a draft model; n-gram: no D)
    time(N)   = Vp + O(0) + [k > 0] Dp + (N - 1) / tokens(k) * step(k)
Vp / Dp: the prompt's prefill (the first token comes from it); O(k): the stack's measured
cost per step (linear between the measured k, flat beyond them), 0 for "in-process" (the same
forwards with no hop and no bookkeeping: a bound for HF assisted generation, whose own Python
per step is not counted). "steady" leaves out the prefill. The draft's first forward of a
step reads 2 tokens (the bonus token and the last accepted proposal), the rest 1.

Prints the measured costs, per acceptance the best k and its tokens/s for each path, their
ratios to HF assisted's best measured configuration and to the same path at k=0, and the
draft step cost that would reach --goal x HF's best. JSON: bench/results/ceiling_<dtype>_<isa>.json
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from specdecode.api.client import SpecDecodeClient
from proposer_svc.pruned_head import prune_lm_head
from specdecode.executor.model_runner import ModelRunner, RunnerRow
from specdecode.models.checkpoints import load_model
from specdecode_stack.local import LocalStack, StackConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from adaptive_bench import PROMPTS, hf_generate, metric_total, pair_dirs  # noqa: E402

CPU = torch.device("cpu")
CONTEXT = 64  # cached tokens before a timed forward (a short, warm context)


def widths(spec: str) -> list[int]:
    """"1-9,12,17" -> [1, ..., 9, 12, 17]"""
    out = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return sorted(out)


def timed(run: Callable[[], None], repeats: int) -> float:
    """Median seconds of `repeats` calls after one untimed call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_s(runner: ModelRunner, width: int, repeats: int) -> float:
    """One 1-row forward of `width` new tokens on a warm CONTEXT-token cache."""
    rng = random.Random(width)
    prefix = [rng.randrange(runner.vocab_size) for _ in range(CONTEXT)]
    runner.forward([RunnerRow(-1, prefix, 1)])
    first = [0]

    def run():  # new tokens each time, the first never the last call's: `width` are computed
        first[0] = (first[0] + 1) % runner.vocab_size
        new = [first[0]] + [rng.randrange(runner.vocab_size) for _ in range(width - 1)]
        runner.forward([RunnerRow(-1, prefix + new, width)])
    seconds = timed(run, repeats)
    runner.release([-1])
    return seconds


def prefill_s(runner: ModelRunner, ids: list[int], repeats: int) -> float:
    """The whole prompt through an empty cache (the first token's forward)."""
    def run():
        runner.forward([RunnerRow(-2, ids, 1)])
        runner.release([-2])
    return timed(run, repeats)


def stack_overheads(target_dir, draft: str, dtype: str, ks: list[int], ids: list[int],
                    max_tokens: int, console) -> dict[int, dict]:
    """Per k: what a request at fixed k costs the stack beyond its forwards, per step."""
    config = StackConfig(target_model=str(target_dir), draft_model=draft, tokenizer="none",
                         device="cpu", dtype=dtype, port=0, scoring="multi-query",
                         speculation="fixed", num_speculative_tokens=max(max(ks), 1))
    out = {}
    with LocalStack(config) as stack, SpecDecodeClient(stack.address, timeout_s=3600) as client:
        ports = stack.metrics_ports

        def totals() -> dict[str, float]:
            t = {"steps": metric_total(ports["orchestrator"], "specdecode_steps_total"),
                 "step_s": metric_total(ports["orchestrator"], "specdecode_step_duration_seconds_sum")}
            for role in ("scorer", "proposer"):
                t[role] = metric_total(ports[role], "specdecode_model_forward_seconds_sum", role=role)
            return t
        client.generate(ids, max_tokens=4, num_speculative_tokens=min(ks))  # warm-up
        for k in ks:
            before = totals()
            start = time.perf_counter()
            r = client.generate(ids, max_tokens=max_tokens, num_speculative_tokens=k)
            wall = time.perf_counter() - start
            d = {name: v - before[name] for name, v in totals().items()}
            forwards = d["scorer"] + d["proposer"]
            out[k] = {"wall_s": wall, "steps": d["steps"], "tokens": len(r.token_ids),
                      "prompt_tokens": len(ids),
                      "scorer_forward_s": d["scorer"], "proposer_forward_s": d["proposer"],
                      "overhead_s": (wall - forwards) / d["steps"],
                      "in_steps_s": (d["step_s"] - forwards) / d["steps"],
                      "draft": r.usage.draft_tokens, "accepted": r.usage.accepted_tokens}
            console.print(f"stack ({draft if draft == 'ngram' else 'draft model'}) fixed k={k}: "
                          f"{len(r.token_ids)} tokens in {wall:.2f} s, {d['steps']:.0f} steps, "
                          f"accepted {r.usage.accepted_tokens}/{r.usage.draft_tokens}, forwards "
                          f"{forwards:.2f} s, beyond them {out[k]['overhead_s'] * 1e3:.1f} ms a "
                          f"step ({out[k]['in_steps_s'] * 1e3:.1f} ms within steps)",
                          highlight=False)
    return out


def overhead_fn(measured: dict[int, dict] | None) -> Callable[[int], float]:
    """O(k): k=0 as measured; k > 0 linear between the measured speculative k, flat beyond."""
    if not measured:
        return lambda k: 0.0
    m = {int(k): v["overhead_s"] for k, v in measured.items()}
    spec = sorted(k for k in m if k > 0)

    def o(k: int) -> float:
        if k == 0 or not spec:
            return m.get(0, 0.0)
        if k <= spec[0]:
            return m[spec[0]]
        if k >= spec[-1]:
            return m[spec[-1]]
        j = next(i for i, x in enumerate(spec) if x >= k)
        a, b = spec[j - 1], spec[j]
        return m[a] + (m[b] - m[a]) * (k - a) / (b - a)
    return o


def interp(table: dict[int, float], w: int) -> float:
    """V(w), linear between measured widths (flat beyond the last: never used past it)."""
    if w in table:
        return table[w]
    xs = sorted(table)
    lo, hi = max(x for x in xs if x < w), min(x for x in xs if x > w)
    return table[lo] + (table[hi] - table[lo]) * (w - lo) / (hi - lo)


def expected_tokens(alpha: float, k: int) -> float:
    return k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def tokens_per_s(verify: dict[int, float], k: int, alpha: float, n: int | None,
                 draft: tuple[float, float, float] | None, o: Callable[[int], float],
                 prefill_t: float) -> float:
    """The model above; draft = (D1, D2, Dp) or None (n-gram); n None: steady state."""
    step = verify_cost(verify, k + 1) + o(k)
    if k and draft:
        step += draft[1] + (k - 1) * draft[0]
    per_token = step / expected_tokens(alpha, k)
    if n is None:
        return 1.0 / per_token
    first = prefill_t + o(0) + (draft[2] if k and draft else 0.0)
    return n / (first + (n - 1) * per_token)


def verify_cost(verify: dict[int, float], w: int) -> float:
    return interp(verify, w)


def best_k(verify, ks, alpha, n, draft, o, prefill_t) -> tuple[int, float]:
    return max(((k, tokens_per_s(verify, k, alpha, n, draft, o, prefill_t)) for k in ks),
               key=lambda kv: kv[1])


@click.command()
@click.option("--pair", default="qwen", type=click.Choice(["qwen", "tiny"]), show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--classes", default="code,copy", show_default=True)
@click.option("--widths", "width_spec", default="1-17", show_default=True,
              help="Target forward widths to time (k+1 for k up to the largest minus 1).")
@click.option("--repeats", default=5, show_default=True, help="Timed forwards per cell (median).")
@click.option("--vocab", default=32768, show_default=True, help="Pruned draft head size.")
@click.option("--max-tokens", default=32, show_default=True,
              help="Tokens per request of the HF and stack measurements, and the N the "
                   "ceilings are compared with HF at.")
@click.option("--tokens", default="32,64,128", show_default=True,
              help="N for the n-gram ceiling vs its own k=0 (and the JSON).")
@click.option("--alphas", default="1.0,0.95,0.89", show_default=True,
              help="Acceptance rates the ceilings are computed at.")
@click.option("--hf/--no-hf", default=False, help="Measure HF target-only and assisted.")
@click.option("--hf-k", default="4,8", show_default=True, help="HF assisted constant k.")
@click.option("--stack", "stacks", default="", help="Stacks whose cost per step to measure: "
              "draft (the draft model, on the first class), ngram (on copy, else the first).")
@click.option("--stack-k", default="0,4,8", show_default=True)
@click.option("--overheads-from", type=click.Path(exists=True, path_type=Path),
              help="Take the stacks' cost per step from an earlier run's JSON (e.g. native, "
                   "for AVX2-emulated forwards: RPCs and bookkeeping are not matrix work).")
@click.option("--goal", default=1.3, show_default=True,
              help="The ratio to HF assisted's best the draft step cost is solved for.")
@click.option("--results", default="bench/results", show_default=True,
              type=click.Path(path_type=Path))
def main(pair, dtype, classes, width_spec, repeats, vocab, max_tokens, tokens, alphas, hf, hf_k,
         stacks, stack_k, overheads_from, goal, results) -> None:
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    console = Console(width=200)
    torch_dtype = getattr(torch, dtype)
    target_dir, draft_dir, encode = pair_dirs(pair)
    classes = classes.split(",")
    prompts = {c: encode(PROMPTS[c][0]) for c in classes}
    ws = widths(width_spec)
    alphas = [float(a) for a in alphas.split(",")]
    res = {"dtype": dtype, "isa": isa, "pair": pair, "max_tokens": max_tokens, "context": CONTEXT,
           "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "prompt_tokens": {c: len(p) for c, p in prompts.items()}}

    def save():  # after each part: a run cut short keeps what it measured
        results.mkdir(parents=True, exist_ok=True)
        (results / f"ceiling_{dtype}_{isa}.json").write_text(json.dumps(res, indent=2))

    # -- forwards, one model at a time ------------------------------------------------------
    runner = ModelRunner(load_model(target_dir, CPU, torch_dtype), CPU)
    res["verify_s"] = {w: forward_s(runner, w, repeats) for w in ws}
    res["target_prefill_s"] = {c: prefill_s(runner, p, max(1, repeats // 2)) for c, p in prompts.items()}
    del runner
    runner = ModelRunner(load_model(draft_dir, CPU, torch_dtype), CPU)
    res["draft_prefill_s"] = {c: prefill_s(runner, p, max(1, repeats // 2)) for c, p in prompts.items()}
    heads = {"whole": [forward_s(runner, w, 3 * repeats) for w in (1, 2)]}
    kept = prune_lm_head(runner.model, draft_dir, vocab)
    heads[f"pruned {kept}"] = [forward_s(runner, w, 3 * repeats) for w in (1, 2)]
    res["draft_step_s"] = heads
    del runner
    save()

    # -- HF, measured -----------------------------------------------------------------------
    if hf:
        target = load_model(target_dir, CPU, torch_dtype)
        draft = load_model(draft_dir, CPU, torch_dtype)
        measured = {}
        gc = draft.generation_config
        defaults = gc.num_assistant_tokens, gc.num_assistant_tokens_schedule
        for c, ids in prompts.items():
            runs = {"target-only": hf_generate(target, ids, max_tokens),
                    "assisted defaults": hf_generate(target, ids, max_tokens, assistant_model=draft)}
            for k in [int(x) for x in hf_k.split(",") if x]:
                gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = k, "constant"
                runs[f"assisted k={k}"] = hf_generate(target, ids, max_tokens, assistant_model=draft)
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = defaults
            measured[c] = {name: o.tokens / o.seconds for name, o in runs.items()}
            console.print(f"HF {c}: " + ", ".join(f"{n} {v:.2f}" for n, v in measured[c].items())
                          + " tokens/s", highlight=False)
        res["hf_tokens_per_s"] = measured
        del target, draft
        save()

    # -- the stacks' cost per step beyond forwards --------------------------------------------
    overheads = {}
    if overheads_from:
        overheads = json.loads(overheads_from.read_text()).get("stack_overheads", {})
        res["overheads_from"] = str(overheads_from)
    for kind in [s for s in stacks.split(",") if s]:
        cls = classes[0] if kind == "draft" or "copy" not in classes else "copy"
        overheads[kind] = stack_overheads(target_dir, str(draft_dir) if kind == "draft" else "ngram",
                                          dtype, [int(k) for k in stack_k.split(",")],
                                          prompts[cls], max_tokens, console)
        overheads[kind] = {str(k): {**v, "class": cls} for k, v in overheads[kind].items()}
        res["stack_overheads"] = overheads
        save()
    res["stack_overheads"] = overheads

    report(console, res, classes, alphas, [int(n) for n in tokens.split(",")], max_tokens, goal)
    save()


def report(console, res, classes, alphas, ns, max_tokens, goal) -> None:
    verify = {int(w): s for w, s in res["verify_s"].items()}
    ks = [w - 1 for w in range(1, max(verify) + 1)]
    heads = res["draft_step_s"]
    table = Table(title=f"Measured forwards (ms), {res['dtype']}, CPU capability "
                        f"{res['torch_cpu_capability']} (ATEN_CPU_CAPABILITY={res['isa']}); "
                        f"1 row, {res['context']}-token warm cache")
    table.add_column("target V(w)")
    for w in sorted(verify):
        table.add_column(str(w))
    table.add_row("ms", *(f"{verify[w] * 1e3:.0f}" for w in sorted(verify)))
    table.add_row("/ V(1)", *(f"{verify[w] / verify[1]:.2f}" for w in sorted(verify)))
    console.print(table)
    for head, (d1, d2) in heads.items():
        console.print(f"draft step, {head} head: D1 {d1 * 1e3:.1f} ms, D2 {d2 * 1e3:.1f} ms",
                      highlight=False)
    for c in classes:
        console.print(f"prefill {c} ({res['prompt_tokens'][c]} tokens): target "
                      f"{res['target_prefill_s'][c] * 1e3:.0f} ms, draft "
                      f"{res['draft_prefill_s'][c] * 1e3:.0f} ms", highlight=False)
    overheads = res["stack_overheads"]
    for kind, per_k in overheads.items():
        console.print(f"stack ({kind}) beyond its forwards, per step: " + ", ".join(
            f"k={k} {v['overhead_s'] * 1e3:.1f} ms" for k, v in per_k.items()), highlight=False)
        if res.get("overheads_from"):
            continue
        # The model against the stack's own runs (their steps as counted, forwards as timed here)
        o = overhead_fn(per_k)
        d1, d2 = heads["whole"]
        for k, v in ((int(k), v) for k, v in per_k.items()):
            c, steps = v["class"], v["steps"]
            draft = kind == "draft" and k > 0
            predicted = (res["target_prefill_s"][c] + o(0) + (steps - 1) * (
                verify_cost(verify, k + 1) + o(k) + (d2 + (k - 1) * d1 if draft else 0.0))
                + (res["draft_prefill_s"][c] if draft else 0.0))
            console.print(f"  k={k}: the stack's {steps:.0f} steps priced by the model (forwards as timed here): "
                          f"{predicted:.2f} s; measured {v['wall_s']:.2f} s "
                          f"({v['wall_s'] / predicted:.2f}x)", highlight=False)

    paths = []  # (name, draft (D1, D2) or None, overheads)
    o_draft, o_ngram = overhead_fn(overheads.get("draft")), overhead_fn(overheads.get("ngram"))
    for head, (d1, d2) in heads.items():
        suffix = "" if head == "whole" else f", {head} head"
        if "draft" in overheads:
            paths.append((f"stack, 0.5B draft{suffix}", (d1, d2), o_draft, "draft"))
        paths.append((f"in-process, 0.5B draft{suffix}", (d1, d2), lambda k: 0.0, "draft"))
    if "draft" in overheads:
        paths.append(("stack, a free draft step", (0.0, 0.0), o_draft, "draft"))
    if "ngram" in overheads:
        paths.append(("stack, n-gram", None, o_ngram, "ngram"))
    paths.append(("in-process, n-gram", None, lambda k: 0.0, "ngram"))

    hf = res.get("hf_tokens_per_s", {})
    hf_best = {c: max((v, n) for n, v in hf[c].items() if n.startswith("assisted")) for c in hf}
    ceilings = []
    for alpha in alphas:
        table = Table(title=f"Ceilings at acceptance {alpha}: best k (0..{max(ks)}), tokens/s; "
                            f"steady (no prefill) and at {max_tokens} tokens with the prompt's "
                            f"prefill; vs the same path at k=0 and vs HF assisted's best measured")
        table.add_column("path")
        for c in classes:
            for col in ("steady", f"{max_tokens} tok", "vs own k=0", "vs HF best"):
                table.add_column(f"{c} {col}")
        for name, d, o, kind in paths:
            cells = []
            for c in classes:
                dp = res["draft_prefill_s"][c]
                draft = None if d is None else (d[0], d[1], dp)
                pt = res["target_prefill_s"][c]
                ks_steady = best_k(verify, ks, alpha, None, draft, o, pt)
                k_n, tps = best_k(verify, ks, alpha, max_tokens, draft, o, pt)
                zero = tokens_per_s(verify, 0, alpha, max_tokens, draft, o, pt)
                vs_hf = tps / hf_best[c][0] if c in hf_best else None
                cells += [f"k={ks_steady[0]} {ks_steady[1]:.2f}", f"k={k_n} {tps:.2f}",
                          f"{tps / zero:.2f}x", "-" if vs_hf is None else f"{vs_hf:.2f}x"]
                entry = {"path": name, "alpha": alpha, "class": c,
                         "steady": {"k": ks_steady[0], "tokens_per_s": ks_steady[1]},
                         "at_n": {"n": max_tokens, "k": k_n, "tokens_per_s": tps},
                         "vs_own_k0": tps / zero, "vs_hf_best": vs_hf,
                         "by_n": {n: dict(zip(("k", "tokens_per_s"),
                                              best_k(verify, ks, alpha, n, draft, o, pt)))
                                  for n in ns}}
                for n in ns:
                    entry["by_n"][n]["vs_own_k0"] = entry["by_n"][n]["tokens_per_s"] / \
                        tokens_per_s(verify, 0, alpha, n, draft, o, pt)
                if d is not None and c in hf_best:
                    entry["draft_step_for_goal"] = draft_step_for(
                        goal * hf_best[c][0], verify, ks, alpha, max_tokens, d, dp, o, pt)
                ceilings.append(entry)
            table.add_row(name, *cells)
        console.print(table)
    res["hf_best"] = {c: {"config": n, "tokens_per_s": v} for c, (v, n) in hf_best.items()}
    res["ceilings"] = ceilings
    for c, (v, n) in hf_best.items():
        console.print(f"HF assisted best measured, {c}: {v:.2f} tokens/s ({n}); {goal}x = "
                      f"{goal * v:.2f}", highlight=False)
        for e in ceilings:
            if (e["class"] == c and "draft_step_for_goal" in e and e["path"].startswith("stack")
                    and "free" not in e["path"]):
                need = e["draft_step_for_goal"]
                console.print(f"  {e['path']}, acceptance {e['alpha']}: reaches "
                              f"{e['at_n']['tokens_per_s']:.2f} (k={e['at_n']['k']}); {goal}x "
                              + ("is out of reach even with a free draft step" if need is None
                                 else f"needs a draft step of {need['d1_s'] * 1e3:.1f} ms "
                                      f"(k={need['k']})"), highlight=False)
    for e in ceilings:
        if e["path"].endswith("n-gram") and e["class"] == "copy":
            console.print(f"{e['path']}, copy, acceptance {e['alpha']}: vs its own k=0 " + ", ".join(
                f"{n} tokens {v['vs_own_k0']:.2f}x (k={v['k']})" for n, v in e["by_n"].items())
                + f", steady k={e['steady']['k']}", highlight=False)


def draft_step_for(goal_tps, verify, ks, alpha, n, d, dp, o, pt) -> dict | None:
    """The largest draft step D1 (D2 scaled with it; the draft's prefill kept) at which the
    best k reaches goal_tps at n tokens; None when a free draft step does not."""
    def best(scale):
        return best_k(verify, ks, alpha, n, (d[0] * scale, d[1] * scale, dp), o, pt)
    if best(0.0)[1] < goal_tps:
        return None
    lo, hi = 0.0, 1.0
    while best(hi)[1] >= goal_tps and hi < 64:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if best(mid)[1] >= goal_tps else (lo, mid)
    return {"d1_s": d[0] * lo, "k": best(lo)[0]}


if __name__ == "__main__":
    main()
