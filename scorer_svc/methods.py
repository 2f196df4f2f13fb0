"""The scoring methods by their CLI name."""

from scorer_svc.batch_expansion import BatchExpansionTop1Scorer
from scorer_svc.multi_query import MultiQueryScorer

SCORING_METHODS = {"batch-expansion": BatchExpansionTop1Scorer, "multi-query": MultiQueryScorer}
