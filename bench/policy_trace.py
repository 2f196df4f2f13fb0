"""Why the adaptive policy picks the k it picks: one engine driving the real services of a
local stack, every step's plan printed beside what the step measured.

    python bench/policy_trace.py [--dtype bfloat16] [--classes code] [--max-tokens 64]
    python bench/policy_trace.py --pair tiny --max-tokens 16     # a smoke test in seconds

The services are the stack's (started as `specdecode up` starts them, so their start-up cost
tables are measured the same way); the engine runs in this process with the policy the
orchestrator builds, so its plans can be read. Per step: the chosen k per sequence, whether
it explored, the cap slow start allowed, the draft's lag (catch-up tokens), the predicted
seconds and tokens of the chosen plan, of plain decoding and of the best speculative plan,
the measured propose / score / total seconds, and the learned corrections (draft factor,
catch-up factor, verify factors, RPC and step overheads). The services' tables are printed
as reported at start-up and again at the end (refreshed by live forwards).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import grpc

from orchestrator.config import ResilienceOptions
from orchestrator.engine.request import Request
from orchestrator.engine.core import SpecDecodeEngine
from orchestrator.cluster.fanout import connect_services
from orchestrator.cluster.remote import RemoteProposer, RemoteScorer
from orchestrator.engine.lookahead_pricing import LookaheadPricing
from orchestrator.engine.speculation_policy import SpeculationPolicy
from specdecode.sequence import SamplingParams
from specdecode_stack.local import LocalStack, StackConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is scripts, not a package
from adaptive_bench import PROMPTS, pair_dirs  # noqa: E402


def show_table(name: str, costs) -> None:
    if costs is None:
        print(f"{name}: no table")
        return
    print(f"{name} (seconds; rows x query tokens {costs.tokens}):")
    for r, line in zip(costs.rows, costs.seconds):
        print(f"  {r} rows: " + "  ".join(f"{s:.4f}" for s in line))


def factors(p: SpeculationPolicy) -> str:
    shape = ",".join(f"{w}:{f.value:.2f}" for w, f in sorted(p.verify_shape.items()))
    return (f"draft x{p.draft_factor.value:.2f} catch-up x{p.catch_up_factor.value:.2f} "
            f"verify x{p.verify_host.value:.2f} shape[{shape}] host x{p.host:.2f} rpc {p.rpc_s.value * 1e3:.0f}ms "
            f"propose-rpc {p.propose_rpc_s.value * 1e3:.0f}ms step {p.step_s.value * 1e3:.0f}ms")


@click.command()
@click.option("--pair", default="qwen", type=click.Choice(["qwen", "tiny"]), show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--classes", default="code", show_default=True)
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--k-max", default=4, show_default=True, help="--num-speculative-tokens")
@click.option("--draft", default="model", type=click.Choice(["model", "ngram"]), show_default=True)
@click.option("--two-hosts", is_flag=True,
              help="Pin the proposer to core 0 and the scorer to core 1 (async_bench's two hosts).")
@click.option("--streams", is_flag=True,
              help="The classes' requests at once, one batch (else one after the other).")
@click.option("--async-drafting", default="off", type=click.Choice(["auto", "on", "off"]),
              show_default=True, help="Draft ahead as `up` would (priced with the services' "
              "cores shared, or not with --two-hosts).")
def main(pair, dtype, classes, max_tokens, k_max, draft, two_hosts, streams,
         async_drafting) -> None:
    target_dir, draft_dir, encode = pair_dirs(pair)
    draft_model = str(draft_dir) if draft == "model" else "ngram"
    config = StackConfig(target_model=str(target_dir), draft_model=draft_model, tokenizer="none",
                         device="cpu", dtype=dtype, port=0, num_speculative_tokens=k_max,
                         pin={"proposer": "0", "scorer": "1"} if two_hosts else {})
    with LocalStack(config) as stack:
        proposer, scorer, p_info, s_info = connect_services(
            stack.service_addresses["proposer"], stack.service_addresses["scorer"], [],
            ResilienceOptions(), 60.0)
        show_table("scorer at start-up", s_info.forward_cost.snapshot())
        show_table("draft at start-up", p_info.forward_cost and p_info.forward_cost.snapshot())
        ahead = None if async_drafting == "off" else LookaheadPricing(
            async_drafting, contention=0.0 if two_hosts else 1.0)
        policy = SpeculationPolicy(k_max, scorer_costs=s_info.forward_cost,
                                   draft_costs=p_info.forward_cost,
                                   draft_model=p_info.vocab_size > 0, scoring=s_info.scoring_method,
                                   lookahead=ahead)
        seen = {}
        explore = policy._maybe_explore

        def recording(best, best_spec, plain, est, *rest):
            seen.update(best_spec=best_spec, plain=plain,
                        caps=[a.trusted_k() for a in est])
            seen["chosen"] = explore(best, best_spec, plain, est, *rest)
            return seen["chosen"]
        policy._maybe_explore = recording
        engine = SpecDecodeEngine(proposer, scorer,
                                  max_model_len=min(p_info.max_model_len, s_info.max_model_len),
                                  num_speculative_tokens=k_max, policy=policy, lookahead=ahead)
        try:
            names = classes.split(",")
            for batch in [names] if streams else [[cls] for cls in names]:
                cls = "+".join(batch)
                for name in batch:
                    ids = encode(PROMPTS[name][0])
                    engine.add_request(Request(name, ids, SamplingParams(max_tokens=max_tokens)))
                print(f"\n== {cls}: {max_tokens} tokens each to generate")
                step, total, tokens = 0, 0.0, 0
                while engine.has_unfinished():
                    seen.clear()
                    behind = {s.seq_id: len(s.token_ids) - s.drafted
                              for s in engine.running.values()}
                    outs = engine.step()
                    st = engine.last_step
                    total += st.total_s
                    tokens += sum(len(o.new_token_ids) for o in outs)
                    line = (f"{step:3d} k={st.chosen_k} {','.join(st.k_reasons)} "
                            f"x{st.predicted_speedup:.2f} (best x{st.best_speculative_speedup:.2f}) "
                            f"behind={list(behind.values())} new={st.new_tokens} "
                            f"acc={st.accepted_tokens}/{st.draft_tokens} "
                            f"meas p/s/t={st.propose_s:.3f}/{st.score_s:.3f}/{st.total_s:.3f}")
                    if "chosen" in seen:  # the chosen plan's predicted step
                        chosen = seen["chosen"][0]
                        line += f" pred {chosen.seconds:.3f}s/{chosen.expected_tokens:.2f}tok"
                        line += " ahead" if chosen.ahead else ""
                    if ahead is not None:
                        line += (f" hits/misses {st.lookahead_hits}/{st.lookahead_misses} ready "
                                 f"{st.lookahead_ready} wasted {st.lookahead_wasted} "
                                 f"wait {st.lookahead_wait_s:.3f}s")
                    if "plain" in seen:
                        plain, spec = seen["plain"], seen["best_spec"]
                        line += f" | cap={seen['caps']} plain {plain.seconds:.3f}s"
                        if spec is not None:
                            gain = (spec.expected_tokens / spec.seconds) / (
                                plain.expected_tokens / plain.seconds)
                            line += (f" spec k={spec.ks} {spec.expected_tokens:.2f}tok/"
                                     f"{spec.seconds:.3f}s (x{gain:.2f} plain; "
                                     f"draft {spec.draft_s:.3f} catch-up {spec.catch_up_s:.3f} over {spec.horizon:.0f})")
                    print(line + " | " + factors(policy), flush=True)
                    step += 1
                print(f"== {cls}: {tokens} tokens in {total:.2f} s = {tokens / total:.2f} tokens/s")
            for role, cls_ in (("scorer", RemoteScorer), ("proposer", RemoteProposer)):
                with grpc.insecure_channel(stack.service_addresses[role]) as channel:
                    show_table(f"{role} at the end (refreshed by live forwards)",
                               cls_(channel).model_info().forward_cost)
        finally:
            proposer.close()
            scorer.close()


if __name__ == "__main__":
    main()
