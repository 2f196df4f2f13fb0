"""Proposals and scores, and the two one-method interfaces (vLLM 0.4.2 `spec_decode/interfaces.py`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specdecode.sequence import ExecuteModelRequest, SequenceGroupMetadata


@dataclass
class SpeculativeProposals:
    """Proposal tokens for a batch, with how many each sequence has."""

    # [B, k] long; -1 beyond a sequence's proposal length.
    proposal_token_ids: torch.Tensor
    # [B, k, V] float32 draft probabilities, or None when the proposer has none (n-gram:
    # each proposal is then a point mass). Rows of greedy sequences may be all zero.
    proposal_probs: torch.Tensor | None
    # [B] long; 0 = this sequence does not speculate this step.
    proposal_lens: torch.Tensor
    # Sequences whose proposals were lost (a proposer replica failed or timed out): they
    # decode plainly this step, and the step's proposer time says nothing of its cost.
    fallback: int = 0
    # Sequences whose proposals were drafted ahead, during the previous step's scoring
    # (orchestrator.engine.lookahead): this step's proposer time does not include theirs.
    ahead: int = 0

    def __repr__(self) -> str:
        probs = None if self.proposal_probs is None else tuple(self.proposal_probs.shape)
        return (f"SpeculativeProposals(proposal_token_ids={self.proposal_token_ids.tolist()}, "
                f"proposal_probs={probs}, proposal_lens={self.proposal_lens.tolist()})")


@dataclass
class SpeculativeScores:
    """The target model's view of every proposal position, plus the bonus position."""

    # [B, k+1, V] float32 target probabilities; 0 where a position was not scored.
    # None when no sequence in the batch samples (greedy needs token ids only).
    probs: torch.Tensor | None
    # [B, k+1, V] float32 target log-probabilities; -inf where not scored. None unless asked.
    logprobs: torch.Tensor | None
    # [B, k+1] long target tokens (argmax for greedy, sampled otherwise); -1 where not scored.
    token_ids: torch.Tensor

    def __repr__(self) -> str:
        probs = None if self.probs is None else tuple(self.probs.shape)
        return f"SpeculativeScores(probs={probs}, token_ids={tuple(self.token_ids.shape)})"


def wants_probs(groups: list[SequenceGroupMetadata]) -> bool:
    """Whether proposers and scorers return probabilities: some sequence of the batch
    samples (greedy verification needs token ids only)."""
    return any(not sg.sampling_params.greedy for sg in groups)


def wants_logprobs(groups: list[SequenceGroupMetadata]) -> bool:
    """Whether a scorer returns logprobs: some sequence of the batch asked for them."""
    return any(sg.sampling_params.logprobs is not None for sg in groups)


class SpeculativeProposer(ABC):
    @abstractmethod
    def get_proposals(self, execute_model_req: ExecuteModelRequest) -> SpeculativeProposals:
        raise NotImplementedError

    def release_sequences(self, seq_ids: list[int]) -> int:
        """Forget per-sequence state (KV caches); returns how many were held. Stateless
        proposers hold none."""
        return 0


class SpeculativeScorer(ABC):
    @abstractmethod
    def score_proposals(self, execute_model_req: ExecuteModelRequest,
                        proposals: SpeculativeProposals) -> SpeculativeScores:
        """Probabilities are returned when any sequence samples; logprobs when some
        sequence's sampling params ask for them (`wants_logprobs`)."""
        raise NotImplementedError

    def release_sequences(self, seq_ids: list[int]) -> int:
        """Forget per-sequence state (KV caches); returns how many were held."""
        return 0
