"""The scoring methods by their CLI name, and the scorer a name builds."""

from __future__ import annotations

from scorer_svc.auto import AutoScorer
from scorer_svc.batch_expansion import BatchExpansionTop1Scorer
from scorer_svc.multi_query import MultiQueryScorer
from specdecode.cost_model import ForwardCosts, calibrate
from specdecode.interfaces import SpeculativeScorer
from specdecode.worker import ModelWorker

SCORING_METHODS = {"batch-expansion": BatchExpansionTop1Scorer, "multi-query": MultiQueryScorer}
SCORING_CHOICES = ("auto", *SCORING_METHODS)  # auto: per call, by measured cost


def make_scorer(scoring: str, worker: ModelWorker,
                costs: ForwardCosts | None = None) -> SpeculativeScorer:
    """costs: the target's measured forward costs (auto only; measured here when None)."""
    if scoring == "auto":
        return AutoScorer(worker, costs if costs is not None else calibrate(worker.runner))
    if scoring not in SCORING_METHODS:
        raise ValueError(f"scoring: must be one of {', '.join(SCORING_CHOICES)}, got {scoring!r}")
    return SCORING_METHODS[scoring](worker)
