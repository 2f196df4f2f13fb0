"""What both proposers share: how long each sequence may speculate this step."""

from __future__ import annotations

import torch

from specdecode.sequence import SequenceGroupMetadata


def speculation_len(sg: SequenceGroupMetadata, k: int, max_model_len: int) -> int:
    """0 for a prompt (no KV state yet) or when k proposals plus the bonus token would pass
    the max model length; else the sequence's own k (capped at the step's k)."""
    k_seq = k if sg.num_speculative_tokens is None else min(k, sg.num_speculative_tokens)
    if sg.is_prompt or sg.data.get_len() + k_seq + 1 > max_model_len:
        return 0
    return k_seq


def pack_proposals(token_lists: list[list[int]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged proposals -> proposal_token_ids [B, k] (-1 padded), proposal_lens [B]."""
    ids = torch.full((len(token_lists), k), -1, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return ids, torch.tensor([len(t) for t in token_lists], dtype=torch.long)
