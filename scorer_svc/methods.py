"""The scoring methods by their CLI name, and the scorer a name builds. The names are plain
strings (the command line offers them without loading torch); the functions import what
they build."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdecode.cost_model import ForwardCosts
    from specdecode.interfaces import SpeculativeScorer
    from specdecode.executor.worker import ModelWorker

SCORING_METHODS = ("batch-expansion", "multi-query")
SCORING_CHOICES = ("auto", *SCORING_METHODS)  # auto: per call, by measured cost


def scorer_class(name: str) -> type[SpeculativeScorer]:
    """The scorer class of a method name; ValueError naming the choices otherwise."""
    if name == "batch-expansion":
        from scorer_svc.batch_expansion import BatchExpansionTop1Scorer
        return BatchExpansionTop1Scorer
    if name == "multi-query":
        from scorer_svc.multi_query import MultiQueryScorer
        return MultiQueryScorer
    raise ValueError(f"scoring: must be one of {', '.join(SCORING_CHOICES)}, got {name!r}")


def make_scorer(scoring: str, worker: ModelWorker,
                costs: ForwardCosts | None = None) -> SpeculativeScorer:
    """costs: the target's measured forward costs (auto only; measured here when None)."""
    if scoring == "auto":
        from scorer_svc.auto import AutoScorer
        from specdecode.executor.calibration import calibrate
        return AutoScorer(worker, costs if costs is not None else calibrate(worker.runner))
    return scorer_class(scoring)(worker)
