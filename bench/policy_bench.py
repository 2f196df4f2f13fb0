"""The adaptive policy: why it picks the k it picks, the best any k could give on this CPU,
and the forward costs it prices with.

    python bench/policy_bench.py trace [--pair qwen|tiny] [--classes code] [--max-tokens 64]
    python bench/policy_bench.py ceiling --dtype bfloat16 --hf --stack draft,ngram
    python bench/policy_bench.py forward-costs [--dtypes bfloat16,float32] [--vocab 32768]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/policy_bench.py ...  # no bf16 units

Each subcommand prints one table and writes JSON under bench/results/; every one runs on the
tiny pair (`--pair tiny`) in seconds. See each subcommand's --help.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click
import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the root: bench.harness
from bench.harness import (CPU, PROMPTS, RESULTS, forward_ms, hf_assisted,  # noqa: E402
                           hf_generate, ints, isa, median_s, metric_total, pair_dirs, ratio,
                           save, show, stack_config)
from orchestrator.cluster.fanout import connect_services  # noqa: E402
from orchestrator.cluster.remote import RemoteProposer, RemoteScorer  # noqa: E402
from orchestrator.config import ResilienceOptions  # noqa: E402
from orchestrator.engine.core import SpecDecodeEngine  # noqa: E402
from orchestrator.engine.lookahead_pricing import LookaheadPricing  # noqa: E402
from orchestrator.engine.request import Request  # noqa: E402
from orchestrator.engine.speculation_policy import SpeculationPolicy  # noqa: E402
from proposer_svc.pruned_head import prune_lm_head  # noqa: E402
from specdecode.api.client import SpecDecodeClient  # noqa: E402
from specdecode.executor.calibration import calibrate  # noqa: E402
from specdecode.executor.model_runner import ModelRunner, RunnerRow  # noqa: E402
from specdecode.model_info import share_cores  # noqa: E402
from specdecode.models.checkpoints import load_model  # noqa: E402
from specdecode.sequence import SamplingParams  # noqa: E402
from specdecode_stack.local import LocalStack  # noqa: E402

CONTEXT = 64  # cached tokens before a timed forward (a short, warm context)
PAIR = click.option("--pair", default="qwen", type=click.Choice(["qwen", "tiny"]), show_default=True,
                    help="tiny: random test models, to check the bench in seconds.")


@click.group()
def cli() -> None:
    """The adaptive policy, one question per subcommand."""


# -- measured forwards (ceiling, forward-costs) -----------------------------------------------


def forward_s(runner: ModelRunner, width: int, repeats: int) -> float:
    """One 1-row forward of `width` new tokens on a warm CONTEXT-token cache: the median of
    `repeats` after one untimed."""
    rng = random.Random(width)
    prefix = [rng.randrange(runner.vocab_size) for _ in range(CONTEXT)]
    ms = [forward_ms(runner, [prefix], width, salt, first_id=-1) for salt in range(repeats + 1)]
    runner.release([-1])
    return statistics.median(ms[1:]) / 1000


def prefill_s(runner: ModelRunner, ids: list[int], repeats: int) -> float:
    """The whole prompt through an empty cache (the first token's forward)."""
    def run():
        runner.forward([RunnerRow(-2, ids, 1)])
        runner.release([-2])
    return median_s(run, repeats)


def draft_steps(runner: ModelRunner, draft_dir, vocab: int, repeats: int) -> dict[str, list[float]]:
    """A draft step's forwards of 1 and 2 new tokens (D1, D2) with the whole LM head, then
    with it pruned to the `vocab` most frequent ids (proposer_svc.pruned_head; in place)."""
    heads = {"whole": [forward_s(runner, w, repeats) for w in (1, 2)]}
    kept = prune_lm_head(runner.model, draft_dir, vocab)
    heads[f"pruned {kept}"] = [forward_s(runner, w, repeats) for w in (1, 2)]
    return heads


# -- trace -----------------------------------------------------------------------------------


def traced_policy(p_info, s_info, k_max: int, ahead) -> tuple[SpeculationPolicy, dict]:
    """The policy the orchestrator builds, its exploration step wrapped so that each step's
    plans can be read (`seen`: best speculative, plain, caps, chosen)."""
    policy = SpeculationPolicy(k_max, scorer_costs=s_info.forward_cost,
                               draft_costs=p_info.forward_cost, draft_model=p_info.vocab_size > 0,
                               scoring=s_info.scoring_method, lookahead=ahead)
    seen, explore = {}, policy._maybe_explore

    def recording(best, best_spec, plain, est, *rest):
        seen.update(best_spec=best_spec, plain=plain, caps=[a.trusted_k() for a in est])
        seen["chosen"] = explore(best, best_spec, plain, est, *rest)
        return seen["chosen"]
    policy._maybe_explore = recording
    return policy, seen


def factors(p: SpeculationPolicy) -> str:
    shape = ",".join(f"{w}:{f.value:.2f}" for w, f in sorted(p.verify_shape.items()))
    return (f"draft x{p.draft_factor.value:.2f} catch-up x{p.catch_up_factor.value:.2f} "
            f"verify x{p.verify_host.value:.2f} shape[{shape}] host x{p.host:.2f} rpc {p.rpc_s.value * 1e3:.0f}ms "
            f"propose-rpc {p.propose_rpc_s.value * 1e3:.0f}ms step {p.step_s.value * 1e3:.0f}ms")


def step_line(i: int, st, behind, seen: dict, ahead, policy) -> str:
    """A step's plan beside what it measured, and the policy's learned corrections."""
    line = (f"{i:3d} k={st.chosen_k} {','.join(st.k_reasons)} "
            f"x{st.predicted_speedup:.2f} (best x{st.best_speculative_speedup:.2f}) "
            f"behind={behind} new={st.new_tokens} acc={st.accepted_tokens}/{st.draft_tokens} "
            f"meas p/s/t={st.propose_s:.3f}/{st.score_s:.3f}/{st.total_s:.3f}")
    if "chosen" in seen:  # the chosen plan's predicted step
        chosen = seen["chosen"][0]
        line += f" pred {chosen.seconds:.3f}s/{chosen.expected_tokens:.2f}tok" + " ahead" * chosen.ahead
    if ahead is not None:
        line += (f" hits/misses {st.lookahead_hits}/{st.lookahead_misses} ready "
                 f"{st.lookahead_ready} wasted {st.lookahead_wasted} wait {st.lookahead_wait_s:.3f}s")
    if "plain" in seen:
        plain, spec = seen["plain"], seen["best_spec"]
        line += f" | cap={seen['caps']} plain {plain.seconds:.3f}s"
        if spec is not None:
            gain = (spec.expected_tokens / spec.seconds) / (plain.expected_tokens / plain.seconds)
            line += (f" spec k={spec.ks} {spec.expected_tokens:.2f}tok/{spec.seconds:.3f}s (x{gain:.2f} "
                     f"plain; draft {spec.draft_s:.3f} catch-up {spec.catch_up_s:.3f} over {spec.horizon:.0f})")
    return line + " | " + factors(policy)


def show_costs(name: str, costs) -> None:
    if costs is None:
        print(f"{name}: no table")
        return
    print(f"{name} (seconds; rows x query tokens {costs.tokens}):")
    for r, line in zip(costs.rows, costs.seconds):
        print(f"  {r} rows: " + "  ".join(f"{s:.4f}" for s in line))


def trace_batch(engine, policy, seen, ahead, batch: list[tuple[str, list[int]]],
                max_tokens: int) -> list[dict]:
    """One batch to its end, a line per step; the steps as JSON records."""
    for name, ids in batch:
        engine.add_request(Request(name, ids, SamplingParams(max_tokens=max_tokens)))
    cls, steps = "+".join(n for n, _ in batch), []
    print(f"\n== {cls}: {max_tokens} tokens each to generate")
    while engine.has_unfinished():
        seen.clear()
        behind = [len(s.token_ids) - s.drafted for s in engine.running.values()]
        outs = engine.step()
        st = engine.last_step
        print(step_line(len(steps), st, behind, seen, ahead, policy), flush=True)
        steps.append({"batch": cls, "k": st.chosen_k, "reasons": st.k_reasons,
                      "predicted_speedup": st.predicted_speedup, "new_tokens": st.new_tokens,
                      "tokens": sum(len(o.new_token_ids) for o in outs), "draft": st.draft_tokens,
                      "accepted": st.accepted_tokens, "propose_s": st.propose_s,
                      "score_s": st.score_s, "total_s": st.total_s})
    tokens, seconds = sum(s["tokens"] for s in steps), sum(s["total_s"] for s in steps)
    print(f"== {cls}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.2f} tokens/s")
    return steps


@cli.command()
@PAIR
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--classes", default="code", show_default=True)
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--k-max", default=4, show_default=True, help="--num-speculative-tokens")
@click.option("--draft", default="model", type=click.Choice(["model", "ngram"]), show_default=True)
@click.option("--two-hosts", is_flag=True,
              help="Pin the proposer to core 0 and the scorer to core 1 (async_bench's two hosts).")
@click.option("--streams", is_flag=True,
              help="All the classes' prompts at once, one batch (adaptive_bench's streams; "
              "else each class's first prompt, one after the other).")
@click.option("--async-drafting", default="off", type=click.Choice(["auto", "on", "off"]),
              show_default=True, help="Draft ahead as `up` would (priced with the services' "
              "cores shared, or not with --two-hosts).")
@click.option("--out", default=str(RESULTS / "policy_trace.json"), show_default=True)
def trace(pair, dtype, classes, max_tokens, k_max, draft, two_hosts, streams, async_drafting,
          out) -> None:
    """Why the policy picks the k it picks: one engine in this process driving the real
    services of a local stack (their start-up cost tables measured as `specdecode up`
    measures them), with the policy the orchestrator builds. Per step: the chosen k per
    sequence, whether it explored, the cap slow start allowed, the draft's lag, the predicted
    seconds and tokens of the chosen plan, of plain decoding and of the best speculative
    plan, the measured propose / score / total seconds, and the learned corrections. The
    services' tables are printed at start-up and at the end (refreshed by live forwards);
    the table sums each batch."""
    target_dir, draft_dir, encode = pair_dirs(pair)
    config = stack_config(target_dir, draft_dir if draft == "model" else "ngram", dtype,
                          num_speculative_tokens=k_max,
                          pin={"proposer": "0", "scorer": "1"} if two_hosts else {})
    names = classes.split(",")
    batches = [[(f"{n}{i}", encode(p)) for n in names for i, p in enumerate(PROMPTS[n])]] \
        if streams else [[(n, encode(PROMPTS[n][0]))] for n in names]
    with LocalStack(config) as stack:
        proposer, scorer, p_info, s_info = connect_services(
            stack.service_addresses["proposer"], stack.service_addresses["scorer"], [],
            ResilienceOptions(), 60.0)
        show_costs("scorer at start-up", s_info.forward_cost.snapshot())
        show_costs("draft at start-up", p_info.forward_cost and p_info.forward_cost.snapshot())
        ahead = None if async_drafting == "off" else LookaheadPricing(
            async_drafting, contention=0.0 if two_hosts else 1.0)
        policy, seen = traced_policy(p_info, s_info, k_max, ahead)
        engine = SpecDecodeEngine(proposer, scorer, num_speculative_tokens=k_max, policy=policy,
                                  max_model_len=min(p_info.max_model_len, s_info.max_model_len),
                                  lookahead=ahead, share_cores=share_cores(p_info, s_info))
        try:
            steps = [s for batch in batches for s in trace_batch(engine, policy, seen, ahead, batch,
                                                                 max_tokens)]
            for role, client in (("scorer", RemoteScorer), ("proposer", RemoteProposer)):
                with grpc.insecure_channel(stack.service_addresses[role]) as channel:
                    show_costs(f"{role} at the end (refreshed by live forwards)",
                               client(channel).model_info().forward_cost)
        finally:
            proposer.close()
            scorer.close()
    trace_table(steps, pair, dtype, k_max)
    save(out, pair=pair, dtype=dtype, k_max=k_max, steps=steps)


def trace_table(steps: list[dict], pair: str, dtype: str, k_max: int) -> None:
    rows = []
    for batch in dict.fromkeys(s["batch"] for s in steps):
        mine = [s for s in steps if s["batch"] == batch]
        tokens, seconds = sum(s["tokens"] for s in mine), sum(s["total_s"] for s in mine)
        draft = sum(s["draft"] for s in mine)
        rows.append((batch, len(mine), tokens, f"{seconds:.2f}", f"{tokens / seconds:.2f}",
                     f"{sum(s['accepted'] for s in mine) / draft:.2f}" if draft else "-",
                     f"{statistics.mean(s['predicted_speedup'] for s in mine):.2f}x"))
    show(f"policy trace, {pair} pair, {dtype}, k <= {k_max}",
         ("batch", "steps", "tokens", "step s", "tokens/s", "acceptance", "mean predicted"), rows)


# -- ceiling -----------------------------------------------------------------------------------


def widths(spec: str) -> list[int]:
    """"1-9,12,17" -> [1, ..., 9, 12, 17]"""
    out = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return sorted(out)


def measure_forwards(res: dict, target_dir, draft_dir, dtype, ws, prompts, vocab, repeats) -> None:
    """V(w), the prompts' prefills and the draft's steps, one model at a time."""
    runner = ModelRunner(load_model(target_dir, CPU, dtype), CPU)
    res["verify_s"] = {w: forward_s(runner, w, repeats) for w in ws}
    res["target_prefill_s"] = {c: prefill_s(runner, p, max(1, repeats // 2)) for c, p in prompts.items()}
    del runner  # one model at a time
    runner = ModelRunner(load_model(draft_dir, CPU, dtype), CPU)
    res["draft_prefill_s"] = {c: prefill_s(runner, p, max(1, repeats // 2)) for c, p in prompts.items()}
    res["draft_step_s"] = draft_steps(runner, draft_dir, vocab, 3 * repeats)


def measure_hf(target_dir, draft_dir, dtype, prompts, max_tokens, hf_ks) -> dict:
    """HF target-only and assisted tokens/s per class."""
    target, draft = load_model(target_dir, CPU, dtype), load_model(draft_dir, CPU, dtype)
    measured = {}
    for c, ids in prompts.items():
        runs = {"target-only": [hf_generate(target, ids, max_tokens)],
                **{f"assisted {k}": o for k, o in hf_assisted(target, draft, [ids], max_tokens,
                                                               hf_ks).items()}}
        measured[c] = {name: o.tokens / o.seconds for name, (o,) in runs.items()}
        print(f"HF {c}: " + ", ".join(f"{n} {v:.2f}" for n, v in measured[c].items()) + " tokens/s")
    return measured


def stack_overheads(target_dir, draft: str, dtype: str, ks: list[int], ids: list[int],
                    max_tokens: int) -> dict[int, dict]:
    """Per k: what a request at fixed k costs the stack beyond its forwards, per step."""
    config = stack_config(target_dir, draft, dtype, scoring="multi-query", speculation="fixed",
                          num_speculative_tokens=max(max(ks), 1))
    out = {}
    with LocalStack(config) as stack, SpecDecodeClient(stack.address, timeout_s=3600) as client:
        ports = stack.metrics_ports

        def totals() -> dict[str, float]:
            return {"steps": metric_total(ports["orchestrator"], "specdecode_steps_total"),
                    "step_s": metric_total(ports["orchestrator"], "specdecode_step_duration_seconds_sum"),
                    **{role: metric_total(ports[role], "specdecode_model_forward_seconds_sum", role=role)
                       for role in ("scorer", "proposer")}}
        client.generate(ids, max_tokens=4, num_speculative_tokens=min(ks))  # warm-up
        for k in ks:
            before, start = totals(), time.perf_counter()
            r = client.generate(ids, max_tokens=max_tokens, num_speculative_tokens=k)
            wall = time.perf_counter() - start
            d = {name: v - before[name] for name, v in totals().items()}
            forwards = d["scorer"] + d["proposer"]
            out[k] = {"wall_s": wall, "steps": d["steps"], "tokens": len(r.token_ids),
                      "prompt_tokens": len(ids), "scorer_forward_s": d["scorer"],
                      "proposer_forward_s": d["proposer"], "overhead_s": (wall - forwards) / d["steps"],
                      "in_steps_s": (d["step_s"] - forwards) / d["steps"],
                      "draft": r.usage.draft_tokens, "accepted": r.usage.accepted_tokens}
            print(f"stack ({draft if draft == 'ngram' else 'draft model'}) fixed k={k}: "
                  f"{len(r.token_ids)} tokens in {wall:.2f} s, {d['steps']:.0f} steps, accepted "
                  f"{r.usage.accepted_tokens}/{r.usage.draft_tokens}, forwards {forwards:.2f} s, "
                  f"beyond them {out[k]['overhead_s'] * 1e3:.1f} ms a step "
                  f"({out[k]['in_steps_s'] * 1e3:.1f} ms within steps)")
    return out


def overhead_fn(measured: dict | None) -> Callable[[int], float]:
    """O(k): k=0 as measured; k > 0 linear between the measured speculative k, flat beyond."""
    if not measured:
        return lambda k: 0.0
    m = {int(k): v["overhead_s"] for k, v in measured.items()}
    spec = sorted(k for k in m if k > 0)

    def o(k: int) -> float:
        if k == 0 or not spec:
            return m.get(0, 0.0)
        return interp({x: m[x] for x in spec}, min(max(k, spec[0]), spec[-1]))
    return o


def interp(table: dict[int, float], w: int) -> float:
    """table[w], linear between measured widths (flat beyond the last: never used past it)."""
    if w in table:
        return table[w]
    lo, hi = max(x for x in table if x < w), min(x for x in table if x > w)
    return table[lo] + (table[hi] - table[lo]) * (w - lo) / (hi - lo)


def expected_tokens(alpha: float, k: int) -> float:
    return k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def tokens_per_s(verify: dict[int, float], k: int, alpha: float, n: int | None,
                 draft: tuple[float, float, float] | None, o: Callable[[int], float],
                 prefill_t: float) -> float:
    """The model (`ceiling --help`); draft = (D1, D2, Dp) or None (n-gram); n None: steady."""
    step = interp(verify, k + 1) + o(k)
    if k and draft:
        step += draft[1] + (k - 1) * draft[0]
    per_token = step / expected_tokens(alpha, k)
    if n is None:
        return 1.0 / per_token
    first = prefill_t + o(0) + (draft[2] if k and draft else 0.0)
    return n / (first + (n - 1) * per_token)


def best_k(verify, ks, alpha, n, draft, o, prefill_t) -> tuple[int, float]:
    return max(((k, tokens_per_s(verify, k, alpha, n, draft, o, prefill_t)) for k in ks),
               key=lambda kv: kv[1])


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


def print_costs(res: dict, verify: dict[int, float]) -> None:
    """The measured forwards, and the model against the stacks' own runs."""
    print(f"target V(w) ms, 1 row, {res['context']}-token warm cache: " + ", ".join(
        f"{w}: {verify[w] * 1e3:.0f} ({verify[w] / verify[1]:.2f}x)" for w in sorted(verify)))
    for head, (d1, d2) in res["draft_step_s"].items():
        print(f"draft step, {head} head: D1 {d1 * 1e3:.1f} ms, D2 {d2 * 1e3:.1f} ms")
    for c, n in res["prompt_tokens"].items():
        print(f"prefill {c} ({n} tokens): target {res['target_prefill_s'][c] * 1e3:.0f} ms, "
              f"draft {res['draft_prefill_s'][c] * 1e3:.0f} ms")
    for kind, per_k in res["stack_overheads"].items():
        print(f"stack ({kind}) beyond its forwards, per step: " + ", ".join(
            f"k={k} {v['overhead_s'] * 1e3:.1f} ms" for k, v in per_k.items()))
        if res.get("overheads_from"):
            continue
        o, (d1, d2) = overhead_fn(per_k), res["draft_step_s"]["whole"]
        for k, v in ((int(k), v) for k, v in per_k.items()):
            c, steps, draft = v["class"], v["steps"], kind == "draft" and k > 0
            predicted = (res["target_prefill_s"][c] + o(0) + (steps - 1) * (
                interp(verify, k + 1) + o(k) + (d2 + (k - 1) * d1 if draft else 0.0))
                + (res["draft_prefill_s"][c] if draft else 0.0))
            print(f"  k={k}: the stack's {steps:.0f} steps priced by the model (forwards as timed "
                  f"here): {predicted:.2f} s; measured {v['wall_s']:.2f} s ({v['wall_s'] / predicted:.2f}x)")


def paths_of(res: dict) -> list[tuple]:
    """(name, draft (D1, D2) or None, O(k)) of every path a ceiling is computed for."""
    overheads, paths = res["stack_overheads"], []
    o_draft, o_ngram = overhead_fn(overheads.get("draft")), overhead_fn(overheads.get("ngram"))
    for head, d in res["draft_step_s"].items():
        suffix = "" if head == "whole" else f", {head} head"
        if "draft" in overheads:
            paths.append((f"stack, 0.5B draft{suffix}", d, o_draft))
        paths.append((f"in-process, 0.5B draft{suffix}", d, lambda k: 0.0))
    if "draft" in overheads:
        paths.append(("stack, a free draft step", (0.0, 0.0), o_draft))
    if "ngram" in overheads:
        paths.append(("stack, n-gram", None, o_ngram))
    return paths + [("in-process, n-gram", None, lambda k: 0.0)]


def ceiling_entry(res, verify, ks, alpha, c, path, ns, max_tokens, goal, hf_best) -> dict:
    name, d, o = path
    dp, pt = res["draft_prefill_s"][c], res["target_prefill_s"][c]
    draft = None if d is None else (d[0], d[1], dp)
    steady = best_k(verify, ks, alpha, None, draft, o, pt)
    k_n, tps = best_k(verify, ks, alpha, max_tokens, draft, o, pt)
    zero = lambda n: tokens_per_s(verify, 0, alpha, n, draft, o, pt)  # noqa: E731
    entry = {"path": name, "alpha": alpha, "class": c,
             "steady": {"k": steady[0], "tokens_per_s": steady[1]},
             "at_n": {"n": max_tokens, "k": k_n, "tokens_per_s": tps},
             "vs_own_k0": tps / zero(max_tokens),
             "vs_hf_best": tps / hf_best[c][0] if c in hf_best else None, "by_n": {}}
    for n in ns:
        k, t = best_k(verify, ks, alpha, n, draft, o, pt)
        entry["by_n"][n] = {"k": k, "tokens_per_s": t, "vs_own_k0": t / zero(n)}
    if d is not None and c in hf_best:
        entry["draft_step_for_goal"] = draft_step_for(goal * hf_best[c][0], verify, ks, alpha,
                                                      max_tokens, d, dp, o, pt)
    return entry


def print_goals(ceilings: list[dict], hf_best: dict, goal: float) -> None:
    for c, (v, n) in hf_best.items():
        print(f"HF assisted best measured, {c}: {v:.2f} tokens/s ({n}); {goal}x = {goal * v:.2f}")
        for e in ceilings:
            if (e["class"] == c and "draft_step_for_goal" in e and e["path"].startswith("stack")
                    and "free" not in e["path"]):
                need = e["draft_step_for_goal"]
                print(f"  {e['path']}, acceptance {e['alpha']}: reaches {e['at_n']['tokens_per_s']:.2f} "
                      f"(k={e['at_n']['k']}); {goal}x " + ("is out of reach even with a free draft step"
                      if need is None else f"needs a draft step of {need['d1_s'] * 1e3:.1f} ms (k={need['k']})"))
    for e in ceilings:
        if e["path"].endswith("n-gram") and e["class"] == "copy":
            print(f"{e['path']}, copy, acceptance {e['alpha']}: vs its own k=0 " + ", ".join(
                f"{n} tokens {v['vs_own_k0']:.2f}x (k={v['k']})" for n, v in e["by_n"].items())
                + f", steady k={e['steady']['k']}")


def ceiling_report(res, classes, alphas, ns, max_tokens, goal) -> None:
    verify = {int(w): s for w, s in res["verify_s"].items()}
    ks = [w - 1 for w in range(1, max(verify) + 1)]
    print_costs(res, verify)
    hf = res.get("hf_tokens_per_s", {})
    hf_best = {c: max((v, n) for n, v in hf[c].items() if n.startswith("assisted")) for c in hf}
    res["hf_best"] = {c: {"config": n, "tokens_per_s": v} for c, (v, n) in hf_best.items()}
    res["ceilings"] = [ceiling_entry(res, verify, ks, alpha, c, path, ns, max_tokens, goal, hf_best)
                       for alpha in alphas for path in paths_of(res) for c in classes]
    show(f"Ceilings, {res['dtype']} (ATEN_CPU_CAPABILITY={res['isa']}): best k (0..{max(ks)}) and "
         f"tokens/s, steady (no prefill) and at {max_tokens} tokens with the prompt's prefill; vs "
         f"the same path at k=0 and vs HF assisted's best measured",
         ("acceptance", "path", *(f"{c} {col}" for c in classes
                                   for col in ("steady", f"{max_tokens} tok", "vs own k=0", "vs HF best"))),
         [(alpha, name, *(cell for c in classes for e in res["ceilings"]
                          if (e["alpha"], e["path"], e["class"]) == (alpha, name, c)
                          for cell in (f"k={e['steady']['k']} {e['steady']['tokens_per_s']:.2f}",
                                       f"k={e['at_n']['k']} {e['at_n']['tokens_per_s']:.2f}",
                                       ratio(e["vs_own_k0"]), ratio(e["vs_hf_best"]))))
          for alpha in alphas for name, *_ in paths_of(res)], width=200)
    print_goals(res["ceilings"], hf_best, goal)


@cli.command()
@PAIR
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
def ceiling(pair, dtype, classes, width_spec, repeats, vocab, max_tokens, tokens, alphas, hf,
            hf_k, stacks, stack_k, overheads_from, goal, results) -> None:
    """The best tokens/s any k can give on this CPU, from forwards measured in this process
    (1 row, warm cache, median of --repeats after one untimed run): the target's V(w) for w
    in --widths, the draft's D1 and D2 (whole head, and pruned to --vocab), each prompt's
    prefill. With --stack, the stack's own cost per step beyond its forwards, O(k): (request
    wall time - the services' forward seconds) / steps, from their metrics. With --hf, HF
    target-only and assisted, measured. Per k, at acceptance a (k+1 tokens a step at 1):

    \b
      step(k) = V(k+1) + O(k) + [k > 0] (D2 + (k-1) D1)    (n-gram: no D)
      time(N) = Vp + O(0) + [k > 0] Dp + (N - 1) / ((1 - a^(k+1)) / (1 - a)) * step(k)

    Vp / Dp: the prefills; "in-process" sets O = 0 (a bound for HF assisted generation);
    "steady" leaves out the prefill. Prints the costs, one table of the best k per path and
    acceptance (ratios to the same path at k=0 and to HF assisted's best), and the draft
    step that would reach --goal x HF's best. JSON: ceiling_<dtype>_<isa>.json."""
    torch_dtype = getattr(torch, dtype)
    target_dir, draft_dir, encode = pair_dirs(pair)
    classes = classes.split(",")
    prompts = {c: encode(PROMPTS[c][0]) for c in classes}
    res = {"dtype": dtype, "isa": isa(), "pair": pair, "max_tokens": max_tokens, "context": CONTEXT,
           "prompt_tokens": {c: len(p) for c, p in prompts.items()}, "stack_overheads": {}}
    path = results / f"ceiling_{dtype}_{isa()}.json"
    measure_forwards(res, target_dir, draft_dir, torch_dtype, widths(width_spec), prompts, vocab,
                     repeats)
    save(path, **res)  # after each part: a run cut short keeps what it measured
    if hf:
        res["hf_tokens_per_s"] = measure_hf(target_dir, draft_dir, torch_dtype, prompts,
                                            max_tokens, ints(hf_k))
        save(path, **res)
    if overheads_from:
        res["stack_overheads"] = json.loads(overheads_from.read_text()).get("stack_overheads", {})
        res["overheads_from"] = str(overheads_from)
    for kind in [s for s in stacks.split(",") if s]:
        cls = classes[0] if kind == "draft" or "copy" not in classes else "copy"
        per_k = stack_overheads(target_dir, str(draft_dir) if kind == "draft" else "ngram", dtype,
                                ints(stack_k), prompts[cls], max_tokens)
        res["stack_overheads"][kind] = {str(k): {**v, "class": cls} for k, v in per_k.items()}
        save(path, **res)
    ceiling_report(res, classes, [float(a) for a in alphas.split(",")], ints(tokens), max_tokens,
                   goal)
    save(path, **res)


@cli.command("forward-costs")
@PAIR
@click.option("--dtypes", default="bfloat16,float32", show_default=True)
@click.option("--vocab", default=32768, show_default=True, help="Pruned draft head size.")
@click.option("--repeats", default=15, show_default=True, help="Timed draft steps (median).")
@click.option("--out", default=str(RESULTS / "forward_costs.json"), show_default=True)
def forward_costs(pair, dtypes, vocab, repeats, out) -> None:
    """The pair's measured cost tables (those the services report in ModelInfo.forward_cost,
    specdecode.executor.calibration.calibrate: 1 row x 1..9 tokens) and the draft step with the whole
    LM head and with it pruned to the --vocab most frequent ids, per dtype."""
    target_dir, draft_dir, _ = pair_dirs(pair)
    rows = []
    for dtype in dtypes.split(","):
        for name, path in (("target", target_dir), ("draft", draft_dir)):
            runner = ModelRunner(load_model(path, CPU, getattr(torch, dtype)), CPU)
            costs = calibrate(runner, rows=(1,))
            row = {"dtype": dtype, "model": name, "seconds": dict(zip(map(str, costs.tokens),
                                                                      costs.seconds[0]))}
            if name == "draft":
                row["draft_step_s"] = draft_steps(runner, path, vocab, repeats)
            rows.append(row)
            del runner  # one model at a time
    show(f"Forward costs, {pair} pair, CPU capability {torch.backends.cpu.get_cpu_capability()} "
         f"(ATEN_CPU_CAPABILITY={isa()}); draft step: 1 new token, {CONTEXT}-token warm cache",
         ("dtype", "model", "1 tok s", "2", "3", "5", "9", "5-tok verify / decode",
          "draft step ms: whole / pruned"),
         [(r["dtype"], r["model"], *(f"{r['seconds'][q]:.3f}" for q in ("1", "2", "3", "5", "9")),
           f"{r['seconds']['5'] / r['seconds']['1']:.2f}x",
           " / ".join(f"{d1 * 1e3:.1f} ({head})" for head, (d1, _) in r["draft_step_s"].items())
           if "draft_step_s" in r else "-") for r in rows])
    save(out, pair=pair, rows=rows)


if __name__ == "__main__":
    cli()
