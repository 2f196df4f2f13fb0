"""The adaptive speculation policy on fixed synthetic costs (deterministic): when it
speculates, how it learns acceptance, costs and early stops, how it explores and
prices a draft's catch-up."""

from __future__ import annotations

import pytest

from orchestrator.engine.policy_estimates import draft_seconds, point_pmf
from orchestrator.engine.speculation_policy import Candidate, SpeculationPolicy, expected_tokens
from specdecode.cost_model import ForwardCosts
from tests.support.adaptive import ROWS, TOKENS, policy, table


def teach(p: SpeculationPolicy, seq_id: int, alpha_prefix: int, k: int, steps: int = 10):
    for _ in range(steps):
        p.observe(seq_id, k, k, alpha_prefix)


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5.0


def test_policy_speculates_when_verify_is_flat_and_acceptance_high():
    p = policy(table(0.25, 0.0), table(0.02, 0.0))  # fast-bf16-like: verify ~ decode
    teach(p, 1, 4, 4)  # every proposal accepted
    plan = p.plan([Candidate(1, 8)])
    assert plan.ks == [8] and plan.scoring == "multi-query"


def test_policy_stops_when_multi_token_forwards_are_slow():
    """The issue's AVX2 CPU: a 5-token verify costs ~3.75 decodes; even 96% acceptance
    does not pay with a draft costing a third of the target."""
    p = policy(table(0.37, 0.255), table(0.12, 0.05))
    teach(p, 1, 4, 4)
    assert p.plan([Candidate(1, 8)]).ks == [0]


def test_policy_stops_on_low_acceptance_and_keeps_the_request_cap():
    p = policy(table(0.25, 0.01), table(0.03, 0.0, per_row=0.03))  # draft rows cost
    teach(p, 1, 4, 4)  # high acceptance
    teach(p, 2, 0, 4)  # always rejected at the first token
    plan = p.plan([Candidate(1, 2), Candidate(2, 8), Candidate(3, 0)])
    assert plan.ks == [2, 0, 0]  # 2: the request's cap; 3: a prompt step


def test_policy_stops_for_a_large_compute_bound_batch():
    # Flat at one row (memory-bound), then compute-bound: 10 ms per row-token beyond 50 ms.
    costs = ForwardCosts(ROWS, TOKENS, [[max(0.05, 0.01 * r * q) for q in TOKENS] for r in ROWS])
    p = policy(costs, table(0.005, 0.0))
    for s in range(8):
        teach(p, s, 1, 4)  # ~60% acceptance
    assert max(p.plan([Candidate(0, 8)]).ks) > 0
    assert p.plan([Candidate(s, 8) for s in range(8)]).ks == [0] * 8


def test_policy_learns_acceptance_and_ngram_proposal_rate():
    p = policy(table(0.25, 0.05), None)  # n-gram: no draft forwards
    teach(p, 1, 4, 4)
    assert p.plan([Candidate(1, 4)]).ks == [4]
    hit = p.plan([Candidate(1, 4)]).expected_tokens
    for _ in range(30):  # the proposer stops finding n-grams: fewer expected tokens
        p.observe(1, 4, 0, 0)
    assert p.plan([Candidate(1, 4)]).expected_tokens < 0.5 * hit
    teach(p, 1, 0, 4, steps=30)  # then it finds some, and all are rejected (prose)
    assert p.plan([Candidate(1, 4)]).ks == [0]


def run_steps(p: SpeculationPolicy, steps: int, true_costs: ForwardCosts, accept: bool,
              rpc_s: float = 0.004) -> list:
    """Drive the policy as the engine does, one n-gram sequence whose proposals are all
    accepted (accept) or all rejected, the step times taken from true_costs."""
    plans = []
    for _ in range(steps):
        plan = p.plan([Candidate(1, 4)])
        k = plan.ks[0]
        p.observe(1, k, k, k if accept else 0)
        score_s = rpc_s + true_costs(1, k + 1)
        p.observe_step(plan, [k], 0.001 if k else 0.0, score_s, score_s + 0.002)
        plans.append(plan)
    return plans


def test_policy_mends_a_start_up_table_that_wrongly_says_never_speculate():
    """The table measured at start-up while the other service loaded on the same cores:
    2+ tokens 4x a decode (the stack's real log showed 0.244 s against 0.064 s). The real
    verify costs 1.1x a decode; on a copy task every proposal is accepted."""
    wrong, true = table(0.06, 0.18), table(0.06, 0.0015)
    assert policy(wrong, None).plan([Candidate(1, 4)]).ks == [0]
    plans = run_steps(policy(wrong, None), 40, true, accept=True)
    first = next(i for i, plan in enumerate(plans) if plan.ks[0])
    assert plans[first].explore and first < 10  # measured after EXPLORE_FIRST plain steps
    # then k grows with the sequence's own accepted tokens (at most 4x them) and stays at 4
    assert [plan.ks[0] for plan in plans[first:first + 3]] == [1, 4, 4]
    assert all(plan.ks == [4] and not plan.explore for plan in plans[first + 1:][1:])


def test_exploring_costs_little_when_the_table_is_right():
    """The issue's AVX2 CPU: speculation truly does not pay. Exploration doubles its wait
    each time (8, 16, ... 256 plain steps), so over 2,000 steps it speculates a handful of
    times and the steps take under 1% longer than plain decoding alone."""
    costs = table(0.37, 0.255)
    plans = run_steps(policy(costs, None), 2000, costs, accept=False)
    spec = [plan for plan in plans if plan.ks[0]]
    assert all(plan.explore for plan in spec) and 5 <= len(spec) <= 12
    spent = sum(costs(1, plan.ks[0] + 1) for plan in plans)
    assert spent < 1.01 * 2000 * costs(1, 1)


def test_a_new_sequence_speculates_on_its_own_evidence():
    """Other sequences accepted everything (a high prior), so a new one speculates, but k
    grows with what it had accepted itself: 2, then 8 (at least 2, at most four times its
    accepted tokens); one rejected at its first proposals stays at 2."""
    p = policy(table(0.25, 0.0), table(0.02, 0.0))
    teach(p, 1, 8, 8)
    ks = []
    for _ in range(3):
        ks.append(p.plan([Candidate(2, 8)]).ks[0])
        p.observe(2, ks[-1], ks[-1], ks[-1])
    assert ks == [2, 8, 8]
    assert p.plan([Candidate(3, 8)]).ks == [2]
    p.observe(3, 2, 2, 0)
    assert p.plan([Candidate(3, 8)]).ks[0] <= 2


def test_a_sequence_never_speculates_past_its_end():
    """k + 1 tokens at most per step: a request with 3 tokens left asks for 2, with 1 left
    for none (drafting 16 for the last 6 tokens of a 32-token request cost copy 20%); nor
    wider than the scorer's table measured."""
    p = policy(table(0.25, 0.0, tokens=list(range(1, 18))), table(0.02, 0.0), k_max=16)
    teach(p, 1, 16, 16)
    assert p.plan([Candidate(1, 16, remaining=100)]).ks == [16]
    narrow = policy(table(0.25, 0.0), table(0.02, 0.0), k_max=16)  # widths 1-9 measured
    teach(narrow, 1, 16, 16)
    assert narrow.plan([Candidate(1, 16, remaining=100)]).ks == [8]
    assert p.plan([Candidate(1, 16, remaining=1)]).reasons == ["capped"]
    assert p.plan([Candidate(1, 16, remaining=3)]).ks == [2]
    assert p.plan([Candidate(1, 16, remaining=1)]).ks == [0]


def test_catch_up_is_spread_over_the_tokens_left():
    """A draft that missed 100 tokens reads them in its first forward (10 ms a token here):
    worth it for a request with 64 tokens to go (spread over its ~21 speculative steps),
    not for one with 3 (the whole catch-up lands on one step)."""
    p = policy(table(0.2, 0.01), table(0.02, 0.01))  # verify ~ decode: speculation pays
    teach(p, 1, 3, 4)
    assert p.plan([Candidate(1, 4, behind=1, remaining=64)]).ks == [4]
    far_behind = p.plan([Candidate(1, 4, behind=100, remaining=64)])
    assert far_behind.ks == [4] and far_behind.catch_up_s == pytest.approx(0.98)
    assert p.plan([Candidate(1, 4, behind=100, remaining=3)]).ks == [0]


def test_a_catch_up_is_priced_packed_as_the_runner_runs_it():
    """A request joins three decoding ones 20 tokens behind: the draft's first forward
    reads 20 + 1 + 1 + 1 tokens, packed (the runner pads no row), so it costs the table at
    4 rows of their mean width. Priced padded to the longest (4 x 20 tokens) a join's
    catch-up read 4x dearer here (3.8x on the Qwen draft's start-up table)."""
    widths = [1, 2, 4, 8, 16, 32]
    costs = ForwardCosts([1, 4], widths, [[0.01 + 0.001 * rows * w for w in widths]
                                          for rows in (1, 4)])  # 1 ms a token
    steady, catch_up = draft_seconds(costs, [point_pmf(1)] * 4, [20, 1, 1, 1])
    # steady: 1 token a row, 2 for the joining row (as after a fully accepted proposal)
    assert steady == pytest.approx(0.01 + 0.001 * 5)
    assert catch_up == pytest.approx(0.001 * 18)  # the rest of what the joining row reads


def test_a_catch_up_teaches_its_own_factor():
    """A catch-up forward 3x dearer than the table (a long prefill) must not make the
    draft's steady steps look 3x dearer too: they keep their own factor. (A dearer reading
    is believed from its third step on: Learned's caution.)"""
    p = policy(table(0.2, 0.01), table(0.02, 0.01))
    teach(p, 1, 3, 4)
    plan = p.plan([Candidate(1, 4, behind=1, remaining=60)])
    p.observe_step(plan, [4], 2 * plan.draft_s, 0.24, 0.24 + 2 * plan.draft_s)
    assert p.draft_factor.value == 1.0  # one dearer step: not yet
    for _ in range(2):
        p.observe_step(plan, [4], 2 * plan.draft_s, 0.24, 0.24 + 2 * plan.draft_s)
    assert p.draft_factor.value == pytest.approx(2.0) and p.catch_up_factor.value == 1.0
    plan = p.plan([Candidate(1, 4, behind=50, remaining=64)])
    assert plan.ks[0] and plan.catch_up == pytest.approx(0.48)
    propose_s = 2 * plan.draft_s + 3 * plan.catch_up
    for _ in range(3):
        p.observe_step(plan, plan.ks, propose_s, 0.24, 0.24 + propose_s)
    assert p.draft_factor.value == pytest.approx(2.0) and p.catch_up_factor.value == pytest.approx(3.0)


def run_draft_steps(p: SpeculationPolicy, steps: int, scorer: ForwardCosts, draft: ForwardCosts,
                    prompt: int = 40, rpc_s: float = 0.004, accept: bool = False) -> list:
    """Drive the policy as the engine does, one sequence of a draft model whose proposals
    are all rejected (or all accepted), the step times taken from the true costs `scorer`
    and `draft` (the policy may hold other tables); the draft reads what it missed in its
    first forward (catch-up)."""
    plans, behind, left = [], prompt + 1, steps
    while left > 0:
        plan = p.plan([Candidate(1, 4, behind=behind, remaining=left)])
        k = plan.ks[0]
        p.observe(1, k, k, k if accept else 0)
        propose_s = rpc_s + draft(1, behind) + (k - 1) * draft(1, 1) if k else 0.0
        score_s = rpc_s + scorer(1, k + 1)
        p.observe_step(plan, [k], propose_s, score_s, propose_s + score_s + 0.002)
        behind = (2 if accept else 1) if k else behind + 1
        left -= k + 1 if accept else 1
        plans.append((plan, propose_s + score_s))
    return plans


def test_exploring_with_a_draft_pays_for_its_catch_up():
    """The issue's AVX2 CPU with a draft model: speculation does not pay, and exploring
    makes the draft read the prompt and every token decoded plainly since (12 ms a draft
    token here). A 64-token request is explored once, late: the first exploration's catch-up
    costs over 3% of the request's plain time (measured: one probe cost a 64-token bf16
    request ~17%), so it waits until the plain time decoded on the unchecked tables pays
    for it at 10% -- its one speculative step costs that request under 5%. The tables are
    checked then: later explorations must fit in 2% of the sequence's own plain time,
    whatever other requests decoded plainly before, and a 64-token request never has that.
    A long request checks the start-up table once after 8 plain steps; with a cheaper
    catch-up it is explored now and then, and all of it costs under 2% over plain
    decoding."""
    scorer, draft = table(0.37, 0.255), table(0.05, 0.012)
    p = policy(scorer, draft)
    plans = run_draft_steps(p, 64, scorer, draft)
    assert [plan.explore for plan, _ in plans if plan.ks[0]] == [True] and p.checked
    assert [i for i, (plan, _) in enumerate(plans) if plan.ks[0]][0] > 8  # waited for its budget
    assert sum(s for _, s in plans) < 1.05 * 64 * (0.004 + scorer(1, 1))
    p.forget([1])
    for _ in range(500):  # other requests decoding plainly (k=0): no budget saved for the next
        p.observe(2, 0, 0, 0)
        p.observe_step(p.plan([Candidate(2, 0)]), [0], 0.0, 0.374, 0.376)
    assert not any(plan.ks[0] for plan, _ in run_draft_steps(p, 64, scorer, draft))
    plans = run_draft_steps(policy(scorer, draft), 300, scorer, draft)
    assert [i for i, (plan, _) in enumerate(plans) if plan.ks[0]][:1] == [8]
    draft = table(0.05, 0.004)
    plans = run_draft_steps(policy(scorer, draft), 2000, scorer, draft)
    assert 2 <= sum(1 for plan, _ in plans if plan.ks[0])
    assert all(plan.explore for plan, _ in plans if plan.ks[0])
    assert sum(s for _, s in plans) < 1.02 * 2000 * (0.004 + scorer(1, 1))


def test_a_probe_with_catch_up_mends_a_draft_table_measured_under_load():
    """The fast-bf16 EPYC through the stack: the draft calibrated while the target loaded on
    the same cores reported 1.07 s a forward, against ~0.1 s in traffic (the target's
    table was 1.5x off). The first exploration's draft forward also reads the prompt
    (catch-up), so its time cannot tell the steady cost from the catch-up's: before the
    steady cost was ever measured, both take the same factor. (Charged to the catch-up
    alone, the probe left the steady draft steps priced at 1.07 s and the stack decoded
    accepted code at k=0 for good.) The first plain step runs 0.61x the table's decode:
    the factors are rescaled to that host and the tables count as unchecked, so a 256-token
    request of accepted code is probed at its second step (it waited 8 plain steps before),
    then ramps 1, 3, 4 and stays at 4 (but at its end): 0.50 of plain decoding's time (0.6
    allowed; at k=0 it was 1.0). The probe's predicted loss on this wrong table exceeds 3%
    of a 64-token request's plain time, so that one is not probed (the price of bounding
    what a probe may cost a short request): its reason is no_budget. Its plain time pays
    for the next request's probe (10% of it, up to a quarter of that request): the second
    64-token request is probed at its 8th step and runs in under 0.65 of plain decoding's
    time (before, every short request decoded plainly for good: issue 36's CI failure)."""
    true_scorer, true_draft = table(0.30, 0.01), table(0.10, 0.004)
    wrong_scorer, wrong_draft = table(0.50, 0.01), table(1.07, 0.03)  # as measured
    plans = run_draft_steps(policy(wrong_scorer, wrong_draft), 256, true_scorer, true_draft,
                            prompt=14, accept=True)
    ks = [plan.ks[0] for plan, _ in plans]
    first = next(i for i, k in enumerate(ks) if k)
    assert first == 1 and plans[first][0].explore and plans[first][0].catch_up > 0
    assert plans[0][0].reasons == ["exploration_pending"]
    assert ks[first:first + 3] == [1, 3, 4] and set(ks[first + 2:-1]) == {4}
    assert sum(s for _, s in plans) < 0.6 * 256 * (0.004 + true_scorer(1, 1))
    p = policy(wrong_scorer, wrong_draft)
    plans = run_draft_steps(p, 64, true_scorer, true_draft, prompt=14, accept=True)
    assert not any(plan.ks[0] for plan, _ in plans)
    assert plans[1][0].reasons == ["no_budget"]
    p.forget([1])
    plans = run_draft_steps(p, 64, true_scorer, true_draft, prompt=14, accept=True)
    assert [i for i, (plan, _) in enumerate(plans) if plan.explore] == [8]
    assert sum(s for _, s in plans) < 0.65 * 64 * (0.004 + true_scorer(1, 1))


def test_fixed_policy_speculates_the_cap():
    p = SpeculationPolicy(4, adaptive=False)
    assert p.plan([Candidate(1, 3), Candidate(2, 9), Candidate(3, 0)]).ks == [3, 4, 0]
    # adaptive without costs (an old service) also falls back to fixed k
    assert not SpeculationPolicy(4, scorer_costs=None).adaptive


def drive_early_stop(p: SpeculationPolicy, steps: int, scorer: ForwardCosts, draft: ForwardCosts,
                     stops_after: int, rpc_s: float = 0.004) -> list[tuple]:
    """One sequence of accepted code whose draft stops after `stops_after` tokens whatever
    it is asked for (all accepted), its step times from the true tables."""
    out, behind = [], 2
    for _ in range(steps):
        plan = p.plan([Candidate(1, 16, behind=behind)])
        k = plan.ks[0]
        n = min(k, stops_after)
        p.observe(1, k, n, n)
        propose_s = rpc_s + draft(1, behind) + (n - 1) * draft(1, 1) if k else 0.0
        score_s = rpc_s + scorer(1, n + 1)
        p.observe_step(plan, [n], propose_s, score_s, propose_s + score_s + 0.002)
        behind = 2 if k else behind + 1
        out.append((plan, propose_s + score_s + 0.002, n))
    return out


def test_policy_learns_that_drafts_stop_early():
    """A draft that stops after 2 tokens when asked for up to 16: the policy learns the
    continuation, predicts the 3 tokens and the step time such a step really has (within
    10%), and keeps the draft's cost factor at the table's (it priced the 2 forwards that
    ran, not the 16 asked for: charged as 16 the factor fell to ~0.2 and every later
    plan's draft steps were priced 5x too cheap)."""
    scorer, draft = table(0.20, 0.005), table(0.09, 0.002)
    p = policy(scorer, draft, k_max=16, prior=0.9)
    steps = drive_early_stop(p, 40, scorer, draft, stops_after=2)
    plan, seconds, n = steps[-1]
    assert plan.ks[0] > 2 and n == 2
    assert plan.expected_tokens == pytest.approx(3.0, rel=0.1)
    assert plan.seconds == pytest.approx(seconds, rel=0.1)
    assert p.draft_factor.value == pytest.approx(1.0, rel=0.1)
    assert p.seqs[1].continuation(1.0) < 0.65  # 0.5 learned, beside the prior of 1


def test_a_fresh_servers_first_request_probes_at_its_first_decode_step():
    """Native bf16 tables as measured (decode 0.20 s, a verify of 5 0.24 s, a draft step
    0.10 s): at the 0.6 prior a k = 1 step does not pay, so the first request on a fresh
    server used to decode 8 plain steps and then probe with a catch-up 8 tokens longer.
    Fully accepted at its cap (4) speculation would run over 1.5x faster on these tables,
    so it probes at its first decode step, where the catch-up is smallest; the AVX2 tables
    of test_exploring_with_a_draft_pays_for_its_catch_up (1.2x at best) still wait 8
    steps."""
    scorer, draft = table(0.20, 0.01), table(0.10, 0.003)
    plans = run_draft_steps(policy(scorer, draft), 64, scorer, draft, prompt=20, accept=True)
    first = next(i for i, (plan, _) in enumerate(plans) if plan.ks[0])
    assert first == 0 and plans[0][0].explore
    assert max(plan.ks[0] for plan, _ in plans) == 4  # and then speculates on its evidence


def test_ngram_copy_on_avx2_costs_speculates_k2_from_its_first_proposal():
    """bench13's AVX2-bf16 forwards (bench/policy_bench.py ceiling: a verify of 2, 3, 5, 9 tokens costs
    1.48, 1.96, 3.66, 6.49 decodes): on a copy task k = 2 is the best k (1.53x a decode's
    tokens per second, k = 1 1.35x). A copy request's n-gram finds nothing for its first
    two proposals (the answer's first tokens are not in the prompt yet), then everything is
    accepted. On a warm server a new copy request proposes 2 from its first step; with
    trust starting at 1 and doubling it spent its first steps at k = 1 (measured through
    the stack: 1.04x own k=0 at a mean k of ~1, against a ceiling of 1.22-1.28x)."""
    ms = {1: 124, 2: 183, 3: 242, 5: 451, 9: 801}
    costs = ForwardCosts(ROWS, TOKENS, [[r * ms[q] / 1000 for q in TOKENS] for r in ROWS])
    p = policy(costs, None, k_max=8)
    for r in range(2):
        left, ks, asked = 63, [], 0
        while left > 0:
            plan = p.plan([Candidate(r, 8, remaining=left)])
            k = plan.ks[0]
            n = k if asked >= 2 else 0  # the n-gram finds nothing in its first two tries
            asked += 1 if k else 0
            p.observe(r, k, n, n)
            score_s = 0.004 + costs(1, n + 1)
            p.observe_step(plan, [n], 0.003 if k else 0.0, score_s, score_s + 0.004)
            ks.append(k)
            left -= n + 1
        p.forget([r])
    assert ks[:5] == [2] * 5 and sorted(ks)[len(ks) // 2] == 2


def test_the_unchecked_budget_outlives_a_moving_host():
    """Two busy loops that stay (issue 36's busy-loop run): the plain steps' host scale keeps
    moving past HOST_DRIFT, and each move marks the tables unchecked again. The plain time
    decoded on unchecked tables must still add up across the moves and pay for the next
    request's probe: zeroed at every move, the stack decoded plainly for good (`no_budget`
    on 29 of 52 steps where an idle-started stack chose k=4)."""
    true_scorer, true_draft = table(0.30, 0.01), table(0.10, 0.004)
    wrong_scorer, wrong_draft = table(0.50, 0.01), table(1.07, 0.03)
    p = policy(wrong_scorer, wrong_draft)
    plans = run_draft_steps(p, 64, true_scorer, true_draft, prompt=14, accept=True)
    assert not any(plan.ks[0] for plan, _ in plans)
    p.forget([1])
    moves = 0
    for step in range(120):  # other requests, plain: the host doubles or halves every 10 steps
        host = p.host
        plan = p.plan([Candidate(2, 0)])
        p.observe(2, 0, 0, 0)
        p.observe_step(plan, [0], 0.0, 0.304 * (2 if step // 10 % 2 else 1), 0.31)
        moves += p.host != host
    assert moves >= 5 and not p.checked
    p.forget([2])
    plans = run_draft_steps(p, 64, true_scorer, true_draft, prompt=14, accept=True)
    explored = [i for i, (plan, _) in enumerate(plans) if plan.explore]
    assert explored and explored[0] <= 8, [plan.reasons for plan, _ in plans]  # before: no_budget
    assert sum(s for _, s in plans) < 0.65 * 64 * (0.004 + true_scorer(1, 1))


def test_a_catch_up_too_small_to_measure_teaches_no_catch_up_factor():
    """A grammar's forced tokens leave the draft 3 tokens behind on most steps: that catch-up
    costs a millisecond, and the step's noise (20 ms here) over it read a factor of 20,
    which priced a long catch-up 20x and kept the sequence plain. Such a step is read as a
    steady one: the catch-up factor stays, the steady factor takes the noise's small share."""
    p = policy(table(0.2, 0.01), table(0.02, 0.002))
    teach(p, 1, 3, 4)
    for _ in range(9):
        plan = p.plan([Candidate(1, 4, behind=3, remaining=60)])
        assert plan.ks[0] and 0 < plan.catch_up < 0.05 * plan.draft_s
        propose_s = plan.draft_s + plan.catch_up + 0.02
        p.observe_step(plan, plan.ks, propose_s, 0.24, 0.24 + propose_s)
    assert p.catch_up_factor.value == 1.0
    assert 1.0 < p.draft_factor.value < 1.5
    far = p.plan([Candidate(1, 4, behind=77, remaining=60)])
    assert far.ks[0] and far.catch_up_s == pytest.approx(far.catch_up)


def test_a_strong_prior_yields_to_the_sequences_own_evidence():
    """Code prompts left a prior of 16 trials at 0.9; a prose sequence then accepts half of
    its first and of its later positions (k = 4: one step rejects the first proposal, the
    next accepts two and rejects the third). Its own counts are decayed (DECAY 0.8: about
    4.5 trials of first positions after ten steps), so a prior that kept all 16 trials held
    it at ~0.81 for good; yielding a trial per position tested (down to PRIOR_WEIGHT, 2), it
    reads ~0.62 after ten steps, while a fresh sequence still starts at the prior."""
    from orchestrator.engine.policy_estimates import DECAY, Acceptance, Rate
    a, prior = Acceptance(), Rate(0.9, 0.9)
    assert a.alpha(prior, 16.0).first == pytest.approx(0.9)
    for step in range(10):
        a.update(4, 4, 0 if step % 2 == 0 else 2, DECAY)
    assert a.positions == 20
    est = a.alpha(prior, 16.0)
    assert 0.55 < est.first < 0.7 and 0.55 < est.rest < 0.7, est
