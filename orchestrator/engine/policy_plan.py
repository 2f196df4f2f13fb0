"""What the speculation policy plans with: a sequence as it sees it (Candidate), the plan it
returns for a step (Plan), and the rates a plan is judged by (orchestrator.engine.
speculation_policy)."""

from __future__ import annotations

from dataclasses import dataclass, field


# Why a sequence got its k. k > 0: speculate (the costs say it pays), explore (measuring
# them), fixed (--speculation fixed). k = 0: capped (a prompt step, a request's own 0, or
# its last token), low_acceptance, no_match (an n-gram finding nothing), verify_too_dear
# (even full acceptance would not pay), unrealized (predicted to pay, by less than this
# batch size's speculative steps fell short of their predictions beside its plain steps'
# shortfall: Realized); on tables no speculative step has checked yet, exploration_pending
# (one is to come) or no_budget (it was due but would cost more than its budget).
REASONS = ("speculate", "explore", "fixed", "capped", "low_acceptance", "no_match",
           "verify_too_dear", "unrealized", "no_budget", "exploration_pending")


@dataclass
class Candidate:
    """One sequence as the policy sees it this step."""

    seq_id: int
    cap: int  # the most it may speculate (request cap, server max, room left; 0 = none)
    behind: int = 1  # tokens a draft model must read before proposing (1: the last one)
    remaining: int = 1 << 30  # tokens the request may still produce


@dataclass
class Plan:
    ks: list[int]  # [B] speculation length per sequence
    scoring: str  # the scoring method the costs predict ("" when not predicted)
    expected_tokens: float
    seconds: float  # predicted step time (catch-up spread over the steps left)
    explore: bool = False  # speculating although plain decoding was predicted faster
    draft_s: float = 0.0  # the draft table's seconds for the step's steady forwards ...
    catch_up: float = 0.0  # ... and for its catch-up (both before the learned factors)
    catch_up_s: float = 0.0  # predicted seconds of the draft's catch-up (whole, not spread)
    horizon: float = 1.0  # speculative steps the catch-up is spread over
    behind: list[int] | None = None  # [B] tokens each row's draft had to read first
    speedup: float = 1.0  # predicted tokens/s over plain decoding's (1: plain, or unpriced)
    best_speedup: float = 1.0  # the best speculative plan's (below 1: why it decodes plainly)
    reasons: list[str] = field(default_factory=list)  # [B] why each k (REASONS)
    draft_seconds: float = 0.0  # the draft's part of `seconds` in lockstep (call included)
    ahead: bool = False  # priced drafting ahead (orchestrator.engine.lookahead_pricing)
    verify_seconds: float = 0.0  # the scoring call's predicted seconds (0: not priced)


def rate(plan: Plan) -> float:
    """Expected tokens per second."""
    return plan.expected_tokens / plan.seconds


def steady_rate(plan: Plan) -> float:
    """Expected tokens per second without the catch-up (a step after the first)."""
    return plan.expected_tokens / max(plan.seconds - plan.catch_up_s / plan.horizon, 1e-9)


def horizon(plan: Plan, candidates: list[Candidate]) -> float:
    """Speculative steps a catch-up is spread over: the tokens the speculating sequences
    have left, at the plan's expected tokens per sequence-step (at least 1)."""
    left = [c.remaining for c, k in zip(candidates, plan.ks) if k]
    per_seq_step = plan.expected_tokens / len(plan.ks)
    return max(1.0, sum(left) / len(left) / per_seq_step)
