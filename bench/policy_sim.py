"""The speculation policy alone, stepped through simulated requests: does it settle on the k
that pays when its start-up tables are off and the host is noisy? No models, seconds to run.

    python bench/policy_sim.py [--noise 0,0.2,0.4] [--seeds 6]

The pair is test_policy_recovery's (every proposal accepted). Its services' tables were
taken from one run of that test beside two busy loops (2-core EPYC, 46daa09): IDLE, the
idle-started stack's (the host as it then ran), and BUSY, the stack started under two more
loops (the scorer's decode 1.9x IDLE's, its 2-token verify 3.3x). A simulated step takes
IDLE's seconds for what it runs (the draft's catch-up and k decodes, the scorer's k + 1
tokens; 4 ms a call around them), each call, with probability `noise`, 1.5x, 2.5x or 4x
that (a time slice lost to another process). Three 32-token requests (prompts of 4, 11 and
4 tokens; the draft reads a sequence only when it speculates) twice over, like the test; the
table gives the chosen k of the second pass: its mode per seed, and the histogram and
reasons of the last seed. Same seeds, same numbers.

At b915487 (the policy as at 0b56a55) with noise 0.2-0.4, 1 seed in 6 of the BUSY-started
policy decoded plainly for most of the second pass ("unrealized", "verify_too_dear"), where
IDLE-started ones chose 2-4.
"""

from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.engine.speculation_policy import Candidate, SpeculationPolicy  # noqa: E402
from specdecode.cost_model import ForwardCosts  # noqa: E402

SCORER_TOKENS, DRAFT_TOKENS = [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 10, 20, 40]
IDLE = {  # ms, rows 1 and 4
    "scorer": [[129.8, 170.6, 208.2, 181.9, 204.0], [208.0, 217.9, 260.4, 293.5, 332.5]],
    "proposer": [[2.13, 7.25, 2.56, 2.36, 2.48, 3.28, 7.57, 9.31],
                 [2.53, 7.25, 7.28, 3.64, 9.02, 10.14, 17.16, 39.45]]}
BUSY = {
    "scorer": [[242.3, 562.5, 407.5, 433.9, 365.2], [438.9, 733.5, 501.0, 452.7, 542.7]],
    "proposer": [[1.13, 1.43, 2.66, 2.29, 1.76, 1.99, 2.96, 7.38],
                 [2.07, 1.88, 2.66, 2.59, 2.70, 7.89, 9.43, 17.29]]}
K, MAX_TOKENS, PROMPTS, RPC_S, STEP_S = 4, 32, (4, 11, 4), 0.004, 0.003


def tables(ms: dict) -> tuple[ForwardCosts, ForwardCosts]:
    """(scorer, draft) tables from milliseconds."""
    def costs(grid, tokens):
        return ForwardCosts([1, 4], tokens, [[x / 1e3 for x in line] for line in grid])
    return costs(ms["scorer"], SCORER_TOKENS), costs(ms["proposer"], DRAFT_TOKENS)


def simulate(start: dict, seed: int, noise: float) -> list[tuple[Counter, Counter]]:
    """Each pass's chosen k and reasons (decode steps), the policy starting on `start`."""
    rng = random.Random(seed)
    scorer, draft = tables(IDLE)  # what the host runs

    def slowed(seconds: float) -> float:
        lost = rng.choice([1.5, 2.5, 4.0]) if rng.random() < noise else 1.0
        return seconds * lost * rng.uniform(0.9, 1.2)
    start_scorer, start_draft = tables(start)
    policy = SpeculationPolicy(K, scorer_costs=start_scorer, draft_costs=start_draft)
    passes, seq_id = [], 0
    for _ in range(2):
        ks, why = Counter(), Counter()
        for prompt in PROMPTS:
            seq_id += 1
            behind, made = prompt, 1  # the prompt step gave the first token
            while made < MAX_TOKENS:
                plan = policy.plan([Candidate(seq_id, K, behind=behind,
                                              remaining=MAX_TOKENS - made)])
                k = plan.ks[0]
                ks[k] += 1
                why[plan.reasons[0]] += 1
                drafting = slowed((draft(1, behind) if behind > 1 else 0.0)
                                  + k * draft(1, 1)) if k else 0.0
                scoring = slowed(scorer(1, k + 1))
                propose_s = RPC_S + drafting if k else 0.0
                score_s = RPC_S + scoring
                total = propose_s + score_s + STEP_S
                policy.observe(seq_id, k, k, k)
                busy = {"scorer": scoring, **({"proposer": drafting} if k else {})}
                policy.observe_step(plan, [k], propose_s, score_s, total, busy)
                policy.observe_outcome(plan, total)
                made, behind = made + k + 1, 1 if k else behind + 1
        passes.append((ks, why))
    return passes


@click.command()
@click.option("--noise", default="0,0.2,0.4", show_default=True,
              help="Chances that a call loses a time slice.")
@click.option("--seeds", default=6, show_default=True)
def main(noise: str, seeds: int) -> None:
    print("noise  start  second pass's mode per seed  last seed's second pass (k: steps; reasons)")
    for p in (float(x) for x in noise.split(",")):
        for name, start in (("idle", IDLE), ("busy", BUSY)):
            runs = [simulate(start, s, p)[1] for s in range(seeds)]
            modes = [ks.most_common(1)[0][0] for ks, _ in runs]
            ks, why = runs[-1]
            print(f"{p:<6} {name:<6} {modes}  {dict(sorted(ks.items()))}; {dict(why)}")


if __name__ == "__main__":
    main()
