"""Synthetic forward-cost tables and a policy built on them (deterministic decisions),
and the prompts the adaptive tests decode."""

from __future__ import annotations

from orchestrator.engine.speculation_policy import SpeculationPolicy
from specdecode.cost_model import ForwardCosts

ROWS, TOKENS = [1, 4], [1, 2, 3, 5, 9]


def table(decode: float, per_token: float, per_row: float = 0.0,
          tokens: list[int] = TOKENS) -> ForwardCosts:
    """decode seconds for one row and token, + per_token for each further query token,
    + per_row for each further row (times its tokens)."""
    return ForwardCosts(ROWS, tokens, [[decode + per_token * (q - 1) + per_row * (r - 1) * q
                                        for q in tokens] for r in ROWS])


def policy(scorer: ForwardCosts, draft: ForwardCosts | None, k_max: int = 8,
           prior: float = 0.6, **kw) -> SpeculationPolicy:
    return SpeculationPolicy(k_max, scorer_costs=scorer, draft_costs=draft,
                             draft_model=draft is not None, prior=prior, **kw)


PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], [7, 8, 9, 7, 8, 9, 7, 8]]
MAX_TOKENS = 16
