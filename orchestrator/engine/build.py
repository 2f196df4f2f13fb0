"""The engine composed the one way every entry point does (orchestrator.serve, the in-process
stack): its speculation policy and, with asynchronous drafting, the pricing both share."""

from __future__ import annotations

import logging

from orchestrator.engine.core import SpecDecodeEngine
from orchestrator.engine.lookahead_pricing import LookaheadPricing
from orchestrator.engine.speculation_policy import SpeculationPolicy
from specdecode.interfaces import SpeculativeProposer, SpeculativeScorer

log = logging.getLogger(__name__)


def build_engine(proposer: SpeculativeProposer, scorer: SpeculativeScorer, *, k: int,
                 adaptive: bool, scoring: str, draft_model: bool, scorer_costs=None,
                 draft_costs=None, async_drafting: str = "off", share_cores: bool = True,
                 **options) -> SpecDecodeEngine:
    """The engine and its speculation policy, composed the one way every entry point does:
    adaptive (k per sequence and step from the services' measured forward costs, k the
    most) or fixed (every sequence speculates k); async_drafting auto | on | off: draft
    ahead where it pays (share_cores: the services compete for the same cores, where it
    never does), always, or never. `options`: SpecDecodeEngine's."""
    ahead = None if async_drafting == "off" else LookaheadPricing(
        async_drafting, contention=1.0 if share_cores else 0.0)
    policy = SpeculationPolicy(k, adaptive=adaptive, scorer_costs=scorer_costs,
                               draft_costs=draft_costs, draft_model=draft_model, scoring=scoring,
                               lookahead=ahead)
    if adaptive and not policy.adaptive:
        log.warning("the services report no forward costs: speculating a fixed k=%d", k)
    return SpecDecodeEngine(proposer, scorer, num_speculative_tokens=k, policy=policy,
                            lookahead=ahead, share_cores=share_cores, **options)
