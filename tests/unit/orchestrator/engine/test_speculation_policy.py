"""The speculation policy on measured forward-cost tables (issue 20): every width priced as
measured, a batch's verify priced by its longest proposal, recovery from a start-up table
taken on a busy host, and a reason for every k. Deterministic: fixed tables, no timing."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from orchestrator.engine.policy_estimates import (PRIOR_WEIGHT, PRIOR_WEIGHT_MAX, length_pmf,
                                                  longest_pmf, mean_length, verify_extra)
from orchestrator.engine import speculation_policy
from orchestrator.engine.speculation_policy import (REASONS, Candidate, SpeculationPolicy,
                                                   expected_tokens)
from specdecode.cost_model import ForwardCosts

# The target's fp32 forward on the 2-core EPYC, V(w) for w = 1..9 in ms (docs/benchmarks.md
# before 2026-12-06, "Why, traced"; git log -p): not monotone in the width, an 8-token verify
# costs 2.0 decodes and a 3-token one 3.6.
FP32_V = [410, 851, 1459, 887, 842, 939, 1195, 818, 956]
# The target's bf16 forward there, w = 1..17 (docs/benchmarks.md before 2026-12-06, "Ceilings").
BF16_V = [176, 167, 170, 191, 191, 205, 214, 211, 268, 281, 282, 291, 284, 294, 296, 313, 326]
WIDTHS9 = list(range(1, 10))


def line(ms: list[float]) -> list[float]:
    return [m / 1000 for m in ms]


def fp32_tables(scale: float = 1.0) -> tuple[ForwardCosts, ForwardCosts]:
    """The measured fp32 target (one row) and a draft of a third of its decode, D2 = 2.1 D1
    as measured (the rest of its widths grow linearly), all times x scale."""
    d1 = 0.137
    draft = [d1 * (1.0 if w == 1 else 2.1 if w == 2 else 0.8 + 0.3 * w) for w in WIDTHS9]
    return (ForwardCosts([1], WIDTHS9, [[scale * s for s in line(FP32_V)]]),
            ForwardCosts([1], WIDTHS9, [[scale * s for s in draft]]))


def accepted_code(p: SpeculationPolicy, seq: int = 1, k: int = 8, steps: int = 20) -> None:
    for _ in range(steps):
        p.observe(seq, k, k, k)


def drive(p: SpeculationPolicy, tokens: int, true: tuple[ForwardCosts, ForwardCosts],
          rpc_s: float = 0.004, prompt: int = 20) -> list:
    """One request of accepted code (every proposal accepted) from its first decode step,
    the step times taken from the true tables; the draft reads what it missed (the prompt,
    then every plain step's token) in its first forward."""
    scorer, draft = true
    plans, behind, left = [], prompt + 1, tokens
    while left > 0:
        plan = p.plan([Candidate(1, 8, behind=behind, remaining=left)])
        k = plan.ks[0]
        p.observe(1, k, k, k)
        propose_s = rpc_s + draft(1, behind) + (k - 1) * draft(1, 1) if k else 0.0
        score_s = rpc_s + scorer(1, k + 1)
        p.observe_step(plan, [k], propose_s, score_s, propose_s + score_s + 0.002)
        behind = 2 if k else behind + 1
        left -= k + 1
        plans.append(plan)
    return plans


# -- every width as measured --------------------------------------------------------------

def test_fp32_code_speculates_at_the_cheap_widths_the_envelope_hid():
    """fp32, code after other accepted code (a high prior), no evidence of its own yet: it
    speculates k = 5, the widest whose step risks no more than k = 2's were nothing accepted
    (a 3-token verify is the dear one), then k = 7 on its own evidence (an 8-token verify,
    2.0 decodes; 1.65x plain predicted: one step's evidence of its first token). The monotone envelope across widths priced every
    verify wider than 2 at the 3-token cell (3.6 decodes): the defaults drafted nothing
    (1.00x own k=0) while fixed k = 8 ran 1.44x."""
    scorer, draft = fp32_tables()
    p = SpeculationPolicy(8, scorer_costs=scorer, draft_costs=draft, prior=0.95)
    first = p.plan([Candidate(1, 8, behind=2)])
    assert first.ks == [5] and first.reasons == ["speculate"] and first.speedup > 1.2
    p.observe(1, 5, 5, 5)
    plan = p.plan([Candidate(1, 8, behind=2)])
    assert plan.ks == [7] and plan.speedup == pytest.approx(1.65, abs=0.05)
    enveloped = ForwardCosts([1], WIDTHS9, [[max(line(FP32_V)[:w]) for w in WIDTHS9]])
    old = SpeculationPolicy(8, scorer_costs=enveloped, draft_costs=draft, prior=0.95)
    assert old.plan([Candidate(1, 8, behind=2)]).ks == [0]


# -- a batch's verify is as wide as its longest proposal ------------------------------------

def test_longest_proposal_follows_the_rows_lengths():
    pmfs = [length_pmf(5, 0.7), length_pmf(3, 0.4), length_pmf(0), length_pmf(4, rate=0.6,
                                                                              draft_model=False)]
    exact = [0.0] * 6
    for combo in itertools.product(*(range(len(p)) for p in pmfs)):
        prob = 1.0
        for p, n in zip(pmfs, combo):
            prob *= p[n]
        exact[max(combo)] += prob
    assert longest_pmf(pmfs) == pytest.approx(exact)
    assert sum(length_pmf(6, 0.8)) == pytest.approx(1.0)
    assert mean_length(length_pmf(3, 0.5)) == pytest.approx(1 + 0.5 + 0.25)


def test_a_batch_verify_is_priced_as_it_runs_on_measured_tables():
    """bf16, 4 streams, early stop (each row goes on after a proposal with probability
    0.7, up to 16): the verify's cost follows the rows' proposal lengths, as enumerating
    every combination of them says. Multi-query feeds each row its own tokens (packed): the
    table at 4 rows and their mean width. Batch expansion pads every expanded row to the
    longest proposal + 1: priced at the longest *expected* proposal (width 4) its verify
    would cost 18% less than its real expectation."""
    costs = ForwardCosts([1, 4], list(range(1, 18)), [line(BF16_V), line([4 * v for v in BF16_V])])
    pmfs = [length_pmf(16, 0.7)] * 4
    packed = padded = 0.0
    rows = round(4 + 4 * mean_length(pmfs[0]))
    for combo in itertools.product(range(17), repeat=4):
        prob = 1.0
        for n in combo:
            prob *= pmfs[0][n]
        packed += prob * (costs(4, 1 + sum(combo) / 4) - costs(4, 1))
        padded += prob * (costs(rows, max(combo) + 1) - costs(4, 1))
    assert verify_extra(costs, "multi-query", pmfs, lambda w: 1.0) == pytest.approx(packed)
    assert verify_extra(costs, "batch-expansion", pmfs, lambda w: 1.0) == pytest.approx(padded)
    longest_expected = round(max(mean_length(p) for p in pmfs))
    assert costs(rows, longest_expected + 1) - costs(4, 1) < 0.85 * padded


def test_the_batch_k_is_chosen_jointly():
    """Four streams on bf16 costs: two of accepted code, two of prose rejected at their first
    token. The batch speculates the code rows at the most (their 18 verify tokens cost the
    4-row table at width 5) and leaves the prose rows out (their proposals would cost draft
    rows and verify tokens and gain nothing): the reasons say so."""
    costs = ForwardCosts([1, 4], list(range(1, 10)),
                         [line(BF16_V[:9]), line([2.2 * v for v in BF16_V[:9]])])
    draft = ForwardCosts([1, 4], list(range(1, 10)), [[0.066] * 9, [0.09] * 9])
    p = SpeculationPolicy(8, scorer_costs=costs, draft_costs=draft, prior=0.6)
    for seq in (1, 2):
        accepted_code(p, seq)
    for seq in (3, 4):
        for _ in range(20):
            p.observe(seq, 4, 4, 0)
    plan = p.plan([Candidate(s, 8, behind=2) for s in (1, 2, 3, 4)])
    assert plan.ks == [8, 8, 0, 0]
    assert plan.reasons == ["speculate", "speculate", "low_acceptance", "low_acceptance"]
    assert plan.speedup > 1.5


# -- recovering from a start-up table taken on a busy host ----------------------------------

def moderate_tables(scale: float = 1.0) -> tuple[ForwardCosts, ForwardCosts]:
    """A target whose verify costs 2% more a token, a draft at 60% of its decode: fully
    accepted speculation runs at most 1.4x plain (not enough for a first probe at once)."""
    return (ForwardCosts([1], WIDTHS9, [[scale * (0.2 + 0.02 * (w - 1)) for w in WIDTHS9]]),
            ForwardCosts([1], WIDTHS9, [[scale * (0.12 + 0.01 * (w - 1)) for w in WIDTHS9]]))


def test_a_table_measured_under_load_does_not_lock_speculation_off(monkeypatch):
    """Both start-up tables 3x too dear (timed while busy loops held the cores), the host
    idle since. The first plain step runs at a third of the table's decode: the factors
    follow the host, the tables count as unchecked and the sequence is due, so a 64-token
    request of accepted code is explored at its second step and reaches the k an
    idle-started policy reaches (8). Without following the host (the mutant) the decode
    alone is corrected (the additive term), every speculative step still looks 3x dear,
    the exploration's predicted loss never fits its budget, and all 64 tokens decode
    plainly: the issue's lock-in."""
    true = moderate_tables()
    idle = [plan.ks[0] for plan in drive(SpeculationPolicy(8, scorer_costs=true[0],
                                                           draft_costs=true[1]), 64, true)]
    busy = SpeculationPolicy(8, scorer_costs=moderate_tables(3.0)[0],
                             draft_costs=moderate_tables(3.0)[1])
    plans = drive(busy, 64, true)
    assert plans[0].ks == [0] and plans[0].reasons == ["exploration_pending"]
    assert plans[1].explore and busy.host == pytest.approx(0.34, abs=0.01)
    assert [plan.ks[0] for plan in plans[-4:-1]] == idle[-4:-1] == [8, 8, 8]
    assert len(plans) < 0.3 * len(idle) + len(idle)  # not slower to get there than idle
    monkeypatch.setattr(speculation_policy, "HOST_DRIFT", float("inf"))
    locked = drive(SpeculationPolicy(8, scorer_costs=moderate_tables(3.0)[0],
                                     draft_costs=moderate_tables(3.0)[1]), 64, true)
    assert not any(plan.ks[0] for plan in locked) and locked[-2].reasons == ["no_budget"]


def test_a_load_the_tables_missed_is_not_counted_twice():
    """Both tables timed on an idle host, every forward since twice as slow (a busy loop on
    each service's core: tests/integration/test_second_orchestrator.py with two beside the
    suite). A fresh request's first step explores: its verify, read 2x its table before any
    plain step measured the host, holds the host's scale. Counted as the width's shape and
    then again in the host's scale the plain steps learn, every verify was priced 4x its
    table beside plain decodes at 2x, explorations' predicted losses outgrew their budget
    and the second orchestrator decoded 22 of 29 steps plainly (verify_too_dear). Learned
    over the host as measured, a verify is priced as dear as it is, beside a decode."""
    table, true = fp32_tables(), fp32_tables(2.0)
    p = SpeculationPolicy(8, scorer_costs=table[0], draft_costs=table[1])
    plans = drive(p, 64, true)
    assert plans[0].explore and p.verify_host.n >= 1 and p.verify_shape
    for width in p.verify_shape:  # the table's shape was right: only its scale was off
        priced = p._verify_factor(width) * table[0](1, width) / (
            p._verify_factor(1) * table[0](1, 1))
        assert priced == pytest.approx(true[0](1, width) / true[0](1, 1), rel=0.3), width
    assert sum(1 for plan in plans[1:-1] if not plan.ks[0]) <= 1


# The Qwen 1.5B target's and 0.5B draft's start-up tables at 1 and 4 rows, bf16, one shared
# 2-core EPYC (bench/policy_bench.py trace --streams, 3bcea2f): 4 rows x 4 tokens cost 1.8
# decodes.
QWEN_SCORER_4 = ForwardCosts([1, 4], WIDTHS9, [
    line([102.3, 103.4, 104.8, 105.8, 105.0, 107.7, 129.3, 137.7, 146.9]),
    line([107.3, 146.4, 164.9, 194.5, 284.3, 309.9, 329.0, 371.0, 431.5])])
QWEN_DRAFT_4 = ForwardCosts([1, 4], WIDTHS9 + [18, 36, 72], [
    line([41.2, 45.0, 41.7, 40.5, 42.1, 43.5, 51.1, 52.4, 55.1, 104.7, 165.3, 292.6]),
    line([41.2, 54.0, 59.4, 71.5, 102.8, 114.8, 125.1, 133.9, 157.6, 299.0, 552.3, 992.5])])


def four_streams(slower: float, steps: int, plain_slower: float = 1.0
                 ) -> tuple[SpeculationPolicy, list]:
    """4 rows of code (5 of 6 proposals accepted) on the Qwen tables, each speculative step
    taking `slower` x its predicted seconds (what the corrections leave: widths no step
    measured, costs outside any table), each plain step `plain_slower` x: the plans."""
    p = SpeculationPolicy(8, scorer_costs=QWEN_SCORER_4, draft_costs=QWEN_DRAFT_4,
                          measure_overheads=False)
    p.checked = True
    for seq, n in itertools.product(range(4), range(6)):
        p.observe(seq, 3, 3, 3 - n % 2)
    plans = []
    for _ in range(steps):
        plan = p.plan([Candidate(seq, 8, remaining=200) for seq in range(4)])
        for seq, k in enumerate(plan.ks):
            p.observe(seq, k, k, k - k // 3)
        p.observe_outcome(plan, plan.seconds * (slower if any(plan.ks) else plain_slower))
        plans.append(plan)
    return p, plans


def test_a_batch_size_whose_steps_miss_their_predictions_decodes_plainly():
    """Issue 36, 4 streams: the policy predicted 1.11x and the stack ran 0.88x its own k=0.
    Here every speculative step at 4 rows takes 1.35x its predicted seconds (predicted
    1.3x plain, realised ~0.97x): after REALIZED_MIN steps the batch decodes plainly
    ("unrealized") while one row still speculates, and once the evidence faded below
    REALIZED_MIN (7-14 plain steps) one speculative step tests it again: 10% of the steps
    speculate. Steps that run as predicted change nothing."""
    p, plans = four_streams(1.35, 80)
    assert all(any(plan.ks) for plan in plans[:4]) and plans[0].speedup > 1.25
    spec = [i for i, plan in enumerate(plans) if any(plan.ks)]
    assert spec[:5] == [0, 1, 2, 3, spec[4]] and 7 <= spec[4] - 4 <= 14
    assert plans[4].reasons == ["unrealized"] * 4 and len(spec) <= 0.15 * len(plans)
    assert p.plan([Candidate(9, 8, remaining=200)]).ks[0] > 0  # one row: its own record
    _, as_predicted = four_streams(1.0, 40)
    assert all(any(plan.ks) for plan in as_predicted)


def test_a_miss_plain_steps_share_is_no_reason_to_decode_plainly():
    """Two hosts, lockstep: speculative steps ran 1.35x their predictions, and so did plain
    steps (a miss of the whole host's). Realized corrected speculation only, and the
    adaptive policy fell to 0.74-0.92x its best fixed k (5a9ae75, reverted). Now the few
    plain steps that follow the first correction read the same miss, and speculation
    resumes and stays: at most REALIZED_MIN + 1 plain steps in 80."""
    _, plans = four_streams(1.35, 80, plain_slower=1.35)
    plain = [i for i, plan in enumerate(plans) if not any(plan.ks)]
    assert len(plain) <= 4, plain
    assert plain == list(range(4, 4 + len(plain)))  # one run of them, after the first four


def test_a_remeasured_table_replaces_the_policys():
    """The service re-measured its table while idle (specdecode.serving.recalibration): the next
    plan prices with it, and what was learned against the old table is forgotten."""
    busy, true = fp32_tables(3.0), fp32_tables()
    p = SpeculationPolicy(8, scorer_costs=busy[0], draft_costs=busy[1], prior=0.95)
    accepted_code(p)
    p.rpc_s.add(-0.8)
    p.update_table("scorer", true[0])
    p.update_table("proposer", true[1])
    plan = p.plan([Candidate(1, 8, behind=2)])
    assert p.scorer_costs is true[0] and p.rpc_s.n == 0 and p.host == 1.0
    assert plan.ks == [7]


def test_an_ngram_probe_that_finds_nothing_does_not_count():
    """An exploration whose n-gram lookup found nothing measured nothing: the sequence stays
    due (its wait does not double) and is probed again while its budget lasts."""
    slow = ForwardCosts([1], WIDTHS9, [[0.1 * w for w in WIDTHS9]])  # verify never pays
    p = SpeculationPolicy(4, scorer_costs=slow, draft_model=False)
    ks, waits = [], []
    for step in range(40):
        plan = p.plan([Candidate(1, 4)])
        k = plan.ks[0]
        found = k and step > 20
        p.observe(1, k, k if found else 0, 0)
        p.observe_step(plan, [k if found else 0], 0.002 if k else 0.0,
                       0.004 + slow(1, 1 + (k if found else 0)), 0.11)
        ks.append(k)
        waits.append(p.seqs[1].explore_after)
    probes = [i for i, k in enumerate(ks) if k]
    assert probes[0] == 8 and len(probes) >= 3  # probed again after finding nothing ...
    found_at = next(i for i in probes if i > 20)
    assert waits[found_at - 1] == 8 and waits[found_at] == 16  # ... and the wait doubled
    # once one found tokens: the next probe no sooner than 16 plain steps later
    assert all(i > found_at + 16 for i in probes if i > found_at)


# -- step times as a busy host gives them ---------------------------------------------------

def settled_rate(noise_s: float, alpha: float, draft_decode_s: float,
                 steps: int = 300) -> tuple[float, Counter]:
    """One sequence at per-token acceptance alpha (seeded draws) on the bf16 target table
    (a 5-token verify costs about a decode) and a draft of draft_decode_s a token, every
    step's times the tables' plus noise: within ±noise_s on each call, 5 noise_s on one
    call in ten (a preempted step). Returns the expected tokens per second of the ks the
    policy chose after 50 steps, priced at the true (noiseless) times, and those ks."""
    rng = random.Random(0)
    scorer = ForwardCosts([1], list(range(1, 18)), [line(BF16_V)])
    draft = ForwardCosts([1], WIDTHS9, [[draft_decode_s * (1 + 0.05 * (w - 1)) for w in WIDTHS9]])
    p = SpeculationPolicy(8, scorer_costs=scorer, draft_costs=draft)
    ks, tokens, seconds = Counter(), 0.0, 0.0

    def jitter() -> float:
        return 5 * noise_s if rng.random() < 0.1 else rng.uniform(-noise_s, noise_s)
    for step in range(steps):
        plan = p.plan([Candidate(1, 8, behind=2)])
        k = plan.ks[0]
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        p.observe(1, k, k, accepted)
        drafting = draft(1, 2) + (k - 1) * draft(1, 1) if k else 0.0
        forward = scorer(1, k + 1)
        propose_s = 0.004 + drafting if k else 0.0
        if step >= 50:
            ks[k] += 1
            tokens += expected_tokens(alpha, k)
            seconds += propose_s + 0.004 + forward + 0.001
        noisy = forward + jitter()
        propose_s += jitter() if k else 0.0
        score_s = 0.004 + noisy + jitter()
        p.observe_step(plan, [k], propose_s, score_s, propose_s + score_s + 0.001,
                       {"scorer": noisy, "proposer": drafting})
    return tokens / seconds, ks


@pytest.mark.parametrize("draft_decode_s", [0.066, 0.02])
def test_noisy_step_times_choose_what_exact_ones_do(draft_decode_s):
    """Issue 36: on real pairs the policy sat at k = 1 (or 0) where the best k is deeper.
    In bf16 a 5-token verify costs about a decode, so a factor learned on the cost of
    verifying *beyond* a decode read 20 ms of noise as a 3-20x factor and priced the wider
    verifies out: with these noisy times it decoded plainly on 19% of the steps at 75%
    acceptance. Factors learned on whole forwards, as running medians, choose ks whose true
    speed is what the ks chosen with exact times give (within 5%), rarely plain."""
    for alpha in (0.75, 0.9):
        exact, exact_ks = settled_rate(0.0, alpha, draft_decode_s)
        noisy, noisy_ks = settled_rate(0.02, alpha, draft_decode_s)
        assert noisy >= 0.95 * exact, (alpha, exact, noisy, exact_ks, noisy_ks)
        assert noisy_ks[0] < 0.05 * noisy_ks.total(), (alpha, exact_ks, noisy_ks)


# -- a reason for every k ------------------------------------------------------------------

def test_every_k_has_a_reason():
    scorer, draft = fp32_tables()  # two rows: each the one-row forward (no batching gain)
    scorer = ForwardCosts([1, 2], WIDTHS9, [scorer.seconds[0], [2 * s for s in scorer.seconds[0]]])
    p = SpeculationPolicy(8, scorer_costs=scorer, draft_costs=draft, prior=0.3)
    plan = p.plan([Candidate(1, 0), Candidate(2, 8, behind=2)])
    assert plan.reasons == ["capped", "exploration_pending"] and plan.speedup == 1.0
    assert plan.best_speedup < 1.0  # the tables say speculation would run slower
    p.checked = True  # a speculative step measured these tables
    assert p.plan([Candidate(2, 8, behind=2)]).reasons == ["low_acceptance"]
    dear = ForwardCosts([1], WIDTHS9, [[0.1 * w for w in WIDTHS9]])  # a verify of w costs w decodes
    p = SpeculationPolicy(8, scorer_costs=dear, draft_model=False)
    p.checked = True
    assert p.plan([Candidate(1, 8)]).reasons == ["verify_too_dear"]
    ngram = SpeculationPolicy(8, scorer_costs=moderate_tables()[0], draft_model=False, prior=0.95)
    ngram.checked = True
    ngram.ngram_s.add(0.08)  # a lookup call: 80 ms
    for _ in range(10):
        ngram.observe(1, 4, 0, 0)  # asked, nothing found
    assert ngram.plan([Candidate(1, 8)]).reasons == ["no_match"]
    fixed = SpeculationPolicy(4, adaptive=False).plan([Candidate(1, 4), Candidate(2, 0)])
    assert fixed.reasons == ["fixed", "capped"]
    assert set(REASONS) >= {"speculate", "explore", "no_budget"}


def test_the_step_carries_the_reasons_and_the_predicted_speedup():
    """On the step's statistics, so on its span and in /metrics (orchestrator.engine.step_metrics:
    specdecode_chosen_k's reason label, specdecode_predicted_speedup)."""
    from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model
    from orchestrator.engine.request import Request
    from specdecode.sequence import SamplingParams
    from specdecode_stack.inprocess import build_inprocess_engine

    engine = build_inprocess_engine(build_tiny_model(TinyModelSpec(seed=1)), "ngram",
                                    "multi-query", 4, adaptive=True)
    engine.add_request(Request("a", [1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=4)))
    seen = []
    while engine.has_unfinished():
        engine.step()
        seen.append(engine.last_step.span_attributes())
    assert seen[0]["specdecode.k_reasons"] == ["capped"]  # the prompt step
    for attrs in seen:
        assert len(attrs["specdecode.k_reasons"]) == 1 and set(attrs["specdecode.k_reasons"]) <= set(REASONS)
        assert attrs["specdecode.predicted_speedup"] > 0
        assert "specdecode.best_speculative_speedup" in attrs


# -- the first exploration on fresh tables, and the prior's weight ------------------------

def test_a_fresh_stacks_first_request_explores_at_its_first_decode_step():
    """fp32, fresh tables, the start-up prior (0.6): at prior acceptance the exploration
    (k = 3, the dear 3-token verify) is priced ~0.4 s over plain, above 3% of a 32-token
    request; full acceptance would run ~2x faster, so it is explored at once within a
    quarter of the request (it waited 11 of 32 steps: 0.84x fixed k=8 on code)."""
    scorer, draft = fp32_tables()
    p = SpeculationPolicy(8, scorer_costs=scorer, draft_costs=draft)
    plan = p.plan([Candidate(1, 8, behind=15, remaining=31)])
    assert plan.explore and plan.ks[0] > 0 and plan.reasons == ["explore"]
    p.observe(1, plan.ks[0], plan.ks[0], plan.ks[0])
    p.observe_step(plan, plan.ks, 0.5, 1.2, 1.7)  # the tables are checked: no more at once
    assert p.checked
    later = p.plan([Candidate(2, 8, behind=15, remaining=31)])
    assert not later.explore


def ended(p: SpeculationPolicy, seq: int, accepted_of_8: list[int]) -> None:
    for a in accepted_of_8:
        p.observe(seq, 8, 8, a)
    p.forget([seq])


def test_the_prior_weighs_as_much_as_ended_sequences_accepted_alike():
    """Empirical Bayes: code-like sequences (~0.9 each) make the prior count 16 trials;
    code beside prose (~0.2) keeps it at 2; fewer than three ended sequences: 2."""
    p = SpeculationPolicy(8)
    ended(p, 1, [8, 8, 4] * 3)
    ended(p, 2, [8, 5, 8] * 3)
    assert p.prior_weight.weight() == PRIOR_WEIGHT
    ended(p, 3, [8, 8, 6] * 3)
    assert p.prior_weight.weight() == PRIOR_WEIGHT_MAX
    ended(p, 4, [0, 1, 0] * 3)
    ended(p, 5, [0, 0, 1] * 3)
    assert p.prior_weight.weight() == PRIOR_WEIGHT


def test_one_rejected_exploration_does_not_stop_a_sequence_like_the_others():
    """fp32: after sequences that accepted ~0.9 alike, a sequence whose exploration met a
    disagreement at once (its first of 7 proposals rejected) still speculates: its one
    position weighs against 16 trials of the prior (first-token posterior 0.90). With the
    fixed weight of 2 that posterior is 0.64 (with one α for every position it was 0.61,
    and the sequence decoded plainly: a 32-token copy request ended so before its next
    exploration, 1.75 tok/s, k=0's 2.10). The later positions, which it never tested,
    follow its first: the prior's, scaled by its first over the prior's first."""
    def after_rejection(weight: float | None):
        scorer, draft = fp32_tables()
        p = SpeculationPolicy(8, scorer_costs=scorer, draft_costs=draft)
        for seq in range(1, 5):
            ended(p, seq, [8, 3, 4, 8, 2, 8] * 2)
        if weight is not None:
            p.prior_weight.weight = lambda: weight
        p.observe(9, 7, 7, 0)
        plan = p.plan([Candidate(9, 8, behind=2, remaining=24)])
        return plan.ks, p.all.alpha(0.5, 0.0), p.seqs[9].alpha(p.all.alpha(0.5, 0.0),
                                                               p.prior_weight.weight())
    ks, prior, alike = after_rejection(None)
    assert ks[0] > 0 and alike.first == pytest.approx(0.90, abs=0.01)
    *_, thin = after_rejection(PRIOR_WEIGHT)
    assert thin.first == pytest.approx(0.64, abs=0.01)
    assert alike.rest == pytest.approx(prior.rest * alike.first / prior.first)
    assert thin.rest == pytest.approx(prior.rest * thin.first / prior.first)
    assert thin.rest < alike.rest


# -- a proposal's first token apart from the rest ------------------------------------------

def two_host_tables() -> tuple[ForwardCosts, ForwardCosts]:
    """Two one-core hosts (Qwen 0.5B -> 1.5B, bf16, as async_bench pins them): a target
    decode of 0.33 s, 8 ms more per verify token; a draft token of 0.1 s."""
    return (ForwardCosts([1], WIDTHS9, [[0.33 + 0.008 * (w - 1) for w in WIDTHS9]]),
            ForwardCosts([1], WIDTHS9, [[0.10 + 0.01 * (w - 1) for w in WIDTHS9]]))


def test_a_draft_wrong_on_first_tokens_only_is_trusted_for_long_proposals():
    """Q&A on two hosts: a draft wrong on half the first tokens after the target's and
    right on every later one (its k = 2 steps alternate 0 and 2 accepted). Apart, the first
    token at ~0.5 and the later ones near 1 say a long proposal pays (1 + 0.5 k tokens: 5
    in 1.2 s at k = 8, against 2 in 0.56 s at k = 2); one α for every position (2 of 3,
    0.67) said k = 2. A sequence wrong as often on later tokens (its k = 2 steps alternate
    0 and 1 accepted) stays at k = 1."""
    scorer, draft = two_host_tables()

    def after(accepted_of_2: list[int]):
        p = SpeculationPolicy(8, scorer_costs=scorer, draft_costs=draft, prior=0.5,
                              measure_overheads=False)
        for accepted in accepted_of_2 * 6:
            p.observe(1, 2, 2, accepted)
        rate = p.seqs[1].alpha(p.all.alpha(0.5, 0.0), p.prior_weight.weight())
        return rate, p.plan([Candidate(1, 8, behind=2)]).ks[0]
    rate, k = after([0, 2])
    assert rate.first == pytest.approx(0.54, abs=0.02) and rate.rest > 0.9 and k >= 5
    rate, k = after([0, 1])
    assert rate.rest == rate.first and k == 1
