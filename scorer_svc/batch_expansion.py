"""Batch expansion scoring, as vLLM 0.4.2's BatchExpansionTop1Scorer does it.

Each speculating sequence with n proposal tokens becomes n+1 single-query target sequences
(its tokens with [], [t0], ..., [t0..tn-1] appended) under new sequence ids counted from
max(input ids)+1; sequences that do not speculate are scored as they are, in the same call.
Spans: `batch_expansion.expand`, `target_model.forward`, `batch_expansion.contract`.
The target's output is contracted back to [B, k+1]. Unlike vLLM 0.4.2, proposal lengths may
differ per sequence (n-gram proposals are ragged); a sequence of length n fills n+1 columns.
"""

from __future__ import annotations

import dataclasses
from itertools import count

import torch

from specdecode.telemetry import tracing
from specdecode.interfaces import (SpeculativeProposals, SpeculativeScorer, SpeculativeScores,
                                   wants_logprobs, wants_probs)
from specdecode.sequence import ExecuteModelRequest, SamplerOutput, SequenceGroupMetadata
from specdecode.executor.worker import ModelWorker


def token_ids_to_score(proposal: list[int]) -> list[list[int]]:
    """[t0..tn-1] -> the n+1 continuations [], [t0], [t0,t1], ..., [t0..tn-1]."""
    return [proposal[:i] for i in range(len(proposal) + 1)]


@dataclasses.dataclass
class ExpandedBatch:
    spec_indices: list[int]  # input rows that speculate, in order
    non_spec_indices: list[int]  # input rows scored non-speculatively
    target_groups: list[SequenceGroupMetadata]  # expanded spec rows first, then non-spec rows
    num_scoring_tokens: int  # how many of target_groups are expanded spec rows
    proposal_lens: list[int]  # [B]


def expand_batch(req: ExecuteModelRequest, proposals: SpeculativeProposals) -> ExpandedBatch:
    groups = req.seq_group_metadata_list
    lens = proposals.proposal_lens.tolist()  # [B]
    token_ids = proposals.proposal_token_ids.tolist()  # [B, k]
    spec = [i for i, n in enumerate(lens) if n > 0]
    non_spec = [i for i, n in enumerate(lens) if n == 0]
    # Ids of the expanded batch come after every input id, spec or not (as in vLLM 0.4.2).
    target_ids = count(max((sg.seq_id for sg in groups), default=-1) + 1)
    expanded = []
    for i in spec:
        sg = groups[i]
        for continuation in token_ids_to_score(token_ids[i][:lens[i]]):
            expanded.append(sg.with_appended(continuation, seq_id=next(target_ids),
                                             cache_id=sg.kv_cache_id))
    return ExpandedBatch(spec, non_spec, expanded + [groups[i] for i in non_spec],
                         len(expanded), lens)


def contract_batch(batch: ExpandedBatch, out: SamplerOutput, k: int) -> SpeculativeScores:
    """Expanded rows back to [B, k+1]: -1 tokens, 0 probs, -inf logprobs where absent."""
    B = len(batch.proposal_lens)
    cols: list[tuple[int, int]] = []  # (input row, column) of each expanded row, in order
    for i in batch.spec_indices:
        cols += [(i, j) for j in range(batch.proposal_lens[i] + 1)]
    cols += [(i, 0) for i in batch.non_spec_indices]
    rows = torch.tensor([c[0] for c in cols], dtype=torch.long)
    positions = torch.tensor([c[1] for c in cols], dtype=torch.long)
    return scatter_scores(out, rows, positions, B, k)


def scatter_scores(out: SamplerOutput, rows: torch.Tensor, positions: torch.Tensor,
                   B: int, k: int) -> SpeculativeScores:
    """Place N sampled rows at (rows[n], positions[n]) of [B, k+1] score tensors."""
    token_ids = torch.full((B, k + 1), -1, dtype=torch.long)
    token_ids[rows, positions] = out.sampled_token_ids.cpu()
    probs = logprobs = None
    if out.sampled_token_probs is not None:
        probs = torch.zeros(B, k + 1, out.sampled_token_probs.shape[-1])
        probs[rows, positions] = out.sampled_token_probs.cpu()
    if out.logprobs is not None:
        logprobs = torch.full((B, k + 1, out.logprobs.shape[-1]), float("-inf"))
        logprobs[rows, positions] = out.logprobs.cpu()
    return SpeculativeScores(probs=probs, logprobs=logprobs, token_ids=token_ids)


class BatchExpansionTop1Scorer(SpeculativeScorer):
    def __init__(self, worker: ModelWorker):
        self.worker = worker

    def score_proposals(self, execute_model_req: ExecuteModelRequest,
                        proposals: SpeculativeProposals) -> SpeculativeScores:
        groups = execute_model_req.seq_group_metadata_list
        with tracing.child_span("batch_expansion.expand",
                                  {"specdecode.batch_size": len(groups)}) as span:
            batch = expand_batch(execute_model_req, proposals)
            tracing.set_attributes(span, {"specdecode.expanded_rows": len(batch.target_groups),
                                            "specdecode.spec_sequences": len(batch.spec_indices)})
        want_probs = wants_probs(groups)
        want_logprobs = wants_logprobs(groups)
        with tracing.child_span("target_model.forward",
                                  {"specdecode.batch_size": len(batch.target_groups)}):
            out = self.worker.execute_model(execute_model_req.clone(batch.target_groups),
                                            want_probs=want_probs, want_logprobs=want_logprobs)
        with tracing.child_span("batch_expansion.contract"):
            return contract_batch(batch, out, execute_model_req.num_lookahead_slots)

    def release_sequences(self, seq_ids: list[int]) -> int:
        return self.worker.release_sequences(seq_ids)
