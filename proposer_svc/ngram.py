"""Prompt-lookup (n-gram) proposer: find the sequence's last n tokens earlier in the
sequence and propose what followed them. No probabilities: each proposal is a point mass."""

from __future__ import annotations

from proposer_svc.common import pack_proposals, speculation_len
from specdecode.interfaces import SpeculativeProposals, SpeculativeProposer
from specdecode.sequence import ExecuteModelRequest


def ngram_lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the earliest occurrence of the longest suffix n-gram
    (n from n_max down to n_min), as vLLM proposes; never the suffix itself. [] when
    nothing matches. (The latest occurrence accepted exactly as many tokens on SmolLM2:
    docs/benchmarks.md.)"""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):  # every start before the suffix's own
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class NgramProposer(SpeculativeProposer):
    def __init__(self, max_model_len: int, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram sizes: need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.max_model_len, self.n_min, self.n_max = max_model_len, n_min, n_max

    def get_proposals(self, execute_model_req: ExecuteModelRequest) -> SpeculativeProposals:
        k = execute_model_req.num_lookahead_slots
        proposals = []
        for sg in execute_model_req.seq_group_metadata_list:
            k_seq = speculation_len(sg, k, self.max_model_len)
            tokens = sg.data.get_token_ids()
            proposals.append(ngram_lookup(tokens, k_seq, self.n_min, self.n_max) if k_seq else [])
        ids, lens = pack_proposals(proposals, k)
        return SpeculativeProposals(proposal_token_ids=ids, proposal_probs=None, proposal_lens=lens)
