"""The policy's price of drafting ahead (orchestrator.engine.lookahead_pricing): on separate
cores it is the faster plan and the policy marks it; where the services share cores it
never is, and the policy's plan is lockstep's, unchanged."""

from __future__ import annotations

import pytest

from orchestrator.engine.lookahead_pricing import LookaheadPricing
from orchestrator.engine.policy_plan import Plan, rate
from orchestrator.engine.speculation_policy import Candidate, SpeculationPolicy
from specdecode.cost_model import ForwardCosts

ROWS, TOKENS = [1, 4], [1, 2, 3, 5, 9]


def table(decode: float, per_token: float) -> ForwardCosts:
    return ForwardCosts(ROWS, TOKENS, [[r * (decode + per_token * (q - 1)) for q in TOKENS]
                                       for r in ROWS])


def plan(pricing: LookaheadPricing | None, accepted: int = 4):
    """One core each, bf16-like: a target decode 300 ms (+15 ms a query token), a draft
    forward 110 ms; a sequence whose `accepted` of 4 proposals were accepted, 10 times."""
    p = SpeculationPolicy(8, scorer_costs=table(0.30, 0.015), draft_costs=table(0.11, 0.003),
                          lookahead=pricing)
    for _ in range(10):
        p.observe(1, 4, 4, accepted)
    return p.plan([Candidate(1, 8)])


@pytest.mark.parametrize("accepted", [3, 4])
def test_on_separate_cores_drafting_ahead_is_priced_faster_and_marked(accepted):
    lockstep, ahead = plan(None, accepted), plan(LookaheadPricing("auto", 0.0), accepted)
    assert any(lockstep.ks) and not lockstep.ahead
    assert ahead.ahead and any(ahead.ks)
    # The price is the faster of the two, for the k chosen under it.
    assert rate(ahead) > 1.2 * rate(lockstep)


def test_where_the_services_share_cores_the_plan_is_locksteps():
    lockstep, shared = plan(None), plan(LookaheadPricing("auto", 1.0))
    assert not shared.ahead
    assert (shared.ks, shared.seconds) == (lockstep.ks, lockstep.seconds)


def test_on_drafts_ahead_even_where_it_does_not_pay():
    assert plan(LookaheadPricing("on", 1.0)).ahead


def test_the_guess_rate_is_learned_from_the_lookaheads():
    pricing = LookaheadPricing()
    assert pricing.beta(0.9) == pytest.approx(0.9)  # the prior: the acceptance
    for _ in range(50):
        pricing.observe(full=2, hits=1)
    assert pricing.beta(0.9) == pytest.approx(0.5, abs=0.05)


def test_a_lookahead_drafts_no_longer_than_the_verify_it_runs_beside():
    """Two hosts, bf16: a 0.34 s verify beside a draft of 0.1 s a token: after its guess a
    lookahead drafts 2 tokens (3 forwards fit), whatever the step's k; a hit's step then
    waits for nothing. Unpriced plans (fixed speculation) are not bounded."""
    plan = Plan([8], "multi-query", 6.0, 1.2, draft_seconds=0.3, verify_seconds=0.34)
    assert LookaheadPricing.fit(plan, 0.1) == 2  # not the plan's 0.3 s over 8 (early stops)
    plan.verify_seconds = 0.05  # a verify shorter than one draft token: the guess and one
    assert LookaheadPricing.fit(plan, 0.1) == 1
    assert LookaheadPricing.fit(Plan([8], "", 6.0, 1.2), 0.1) > 8
