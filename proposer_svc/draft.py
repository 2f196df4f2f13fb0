"""Draft-model proposer: k single-token steps of a small model (top-1, no tree).

A greedy sequence proposes the draft's argmax; a sampled one draws from the draft's own
truncated distribution q, which is returned so rejection sampling stays lossless.
Each of the k forward passes is a `draft_model.forward` span.
"""

from __future__ import annotations

import torch

from proposer_svc.common import pack_proposals, speculation_len
from specdecode import tracing
from specdecode.interfaces import SpeculativeProposals, SpeculativeProposer, wants_probs
from specdecode.sequence import ExecuteModelRequest
from specdecode.worker import ModelWorker


class DraftModelProposer(SpeculativeProposer):
    def __init__(self, worker: ModelWorker):
        self.worker = worker

    def get_proposals(self, execute_model_req: ExecuteModelRequest) -> SpeculativeProposals:
        groups = execute_model_req.seq_group_metadata_list
        k = execute_model_req.num_lookahead_slots
        k_seq = [speculation_len(sg, k, self.worker.max_model_len) for sg in groups]  # [B]
        want_probs = wants_probs(groups)
        drafted: list[list[int]] = [[] for _ in groups]
        probs = torch.zeros(len(groups), k, self.worker.vocab_size) if want_probs else None
        for step in range(max(k_seq, default=0)):
            active = [i for i, n in enumerate(k_seq) if n > step]
            batch = [groups[i].with_appended(drafted[i]) for i in active]
            with tracing.child_span("draft_model.forward", {"specdecode.draft_position": step,
                                                              "specdecode.batch_size": len(batch)}):
                out = self.worker.execute_model(execute_model_req.clone(batch),
                                                want_probs=want_probs)
            for row, i in enumerate(active):
                drafted[i].append(int(out.sampled_token_ids[row]))
                if probs is not None:
                    probs[i, step] = out.sampled_token_probs[row]
        ids, lens = pack_proposals(drafted, k)
        return SpeculativeProposals(proposal_token_ids=ids, proposal_probs=probs, proposal_lens=lens)

    def release_sequences(self, seq_ids: list[int]) -> int:
        return self.worker.release_sequences(seq_ids)
