"""Auto scoring: each call goes to multi-query or batch expansion, whichever this
scorer's measured forward costs predict is cheaper for the call's proposal lengths
(specdecode.cost_model.cheaper_scoring). Both scorers share one worker and its KV cache;
the chosen method is a span attribute and a Prometheus label."""

from __future__ import annotations

from opentelemetry import trace
from prometheus_client import Counter

from scorer_svc.batch_expansion import BatchExpansionTop1Scorer
from scorer_svc.multi_query import MultiQueryScorer
from specdecode.telemetry import tracing
from specdecode.cost_model import ForwardCosts, cheaper_scoring
from specdecode.interfaces import SpeculativeProposals, SpeculativeScorer, SpeculativeScores
from specdecode.sequence import ExecuteModelRequest
from specdecode.executor.worker import ModelWorker

CALLS = Counter("specdecode_auto_scoring_calls", "Scoring calls by the method auto scoring "
                "chose (multi-query or batch-expansion).", ["method"])


class AutoScorer(SpeculativeScorer):
    def __init__(self, worker: ModelWorker, costs: ForwardCosts):
        self.worker, self.costs = worker, costs
        self.scorers = {"multi-query": MultiQueryScorer(worker),
                        "batch-expansion": BatchExpansionTop1Scorer(worker)}

    def score_proposals(self, execute_model_req: ExecuteModelRequest,
                        proposals: SpeculativeProposals) -> SpeculativeScores:
        method = cheaper_scoring(self.costs, proposals.proposal_lens.tolist())
        CALLS.labels(method).inc()
        tracing.set_attributes(trace.get_current_span(), {"specdecode.scoring_method": method})
        return self.scorers[method].score_proposals(execute_model_req, proposals)

    def release_sequences(self, seq_ids: list[int]) -> int:
        return self.worker.release_sequences(seq_ids)
