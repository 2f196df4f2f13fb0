"""Verification: which tokens each sequence emits this step, from its proposals and scores."""

from __future__ import annotations

import torch

from orchestrator.engine.rejection_sampler import RejectionSampler
from specdecode.interfaces import SpeculativeProposals, SpeculativeScores
from specdecode.sampling import step_generator
from specdecode.sequence import ExecuteModelRequest


def verify(sampler: RejectionSampler, req: ExecuteModelRequest,
           proposals: SpeculativeProposals,
           scores: SpeculativeScores) -> tuple[list[list[int]], list[int]]:
    """Tokens each sequence emits this step, and how many of its draft tokens passed the
    accept test (vLLM 0.4.2's accepted count; 0 for non-speculating sequences)."""
    groups = req.seq_group_metadata_list
    lens = proposals.proposal_lens  # [B]
    emitted: list[list[int]] = [[int(scores.token_ids[i, 0])] for i in range(len(groups))]
    accepted = [0] * len(groups)
    greedy = [i for i, sg in enumerate(groups) if lens[i] > 0 and sg.sampling_params.greedy]
    sampled = [i for i, sg in enumerate(groups) if lens[i] > 0 and not sg.sampling_params.greedy]
    k = req.num_lookahead_slots
    if greedy:
        out, passed = sampler.greedy(scores.token_ids[greedy],
                                     proposals.proposal_token_ids[greedy])
        for i, row, n in zip(greedy, out.tolist(), passed.tolist()):
            emitted[i], accepted[i] = [t for t in row if t != -1], n
    if sampled:
        rows = torch.tensor(sampled)
        bonus = scores.token_ids[rows].gather(1, lens[rows].unsqueeze(1))  # [S, 1] at n_i
        gens = [step_generator(groups[i].sampling_params, groups[i].data.get_len(), "verify")
                for i in sampled]
        draft_probs = None if proposals.proposal_probs is None else proposals.proposal_probs[rows]
        out, passed = sampler(scores.probs[rows, :k], bonus, draft_probs,
                              proposals.proposal_token_ids[rows], generators=gens)
        for i, row, n in zip(sampled, out.tolist(), passed.tolist()):
            emitted[i], accepted[i] = [t for t in row if t != -1], n
    return emitted, accepted
