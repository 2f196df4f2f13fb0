"""Multi-query scoring: one forward pass feeds each sequence its n proposal tokens and reads
the n+1 last positions, with no expansion. Same SpeculativeScores as batch expansion.
Spans: `multi_query.extend`, `target_model.forward`, `multi_query.scatter`."""

from __future__ import annotations

import torch

from scorer_svc.batch_expansion import scatter_scores
from specdecode.telemetry import tracing
from specdecode.interfaces import (SpeculativeProposals, SpeculativeScorer, SpeculativeScores,
                                   wants_logprobs, wants_probs)
from specdecode.sequence import ExecuteModelRequest
from specdecode.executor.worker import ModelWorker


class MultiQueryScorer(SpeculativeScorer):
    def __init__(self, worker: ModelWorker):
        self.worker = worker

    def score_proposals(self, execute_model_req: ExecuteModelRequest,
                        proposals: SpeculativeProposals) -> SpeculativeScores:
        groups = execute_model_req.seq_group_metadata_list
        with tracing.child_span("multi_query.extend", {"specdecode.batch_size": len(groups)}):
            lens = proposals.proposal_lens.tolist()  # [B]
            token_ids = proposals.proposal_token_ids.tolist()  # [B, k]
            extended = [sg.with_appended(token_ids[i][:lens[i]]) for i, sg in enumerate(groups)]
        want_probs = wants_probs(groups)
        want_logprobs = wants_logprobs(groups)
        with tracing.child_span("target_model.forward", {
                "specdecode.batch_size": len(groups), "specdecode.query_rows": sum(lens) + len(lens)}):
            out = self.worker.score_rows(extended, [n + 1 for n in lens], want_probs, want_logprobs)
        with tracing.child_span("multi_query.scatter"):
            rows = torch.tensor([i for i, n in enumerate(lens) for _ in range(n + 1)],
                                dtype=torch.long)
            positions = torch.tensor([j for n in lens for j in range(n + 1)], dtype=torch.long)
            return scatter_scores(out, rows, positions, len(groups),
                                  execute_model_req.num_lookahead_slots)

    def release_sequences(self, seq_ids: list[int]) -> int:
        return self.worker.release_sequences(seq_ids)
