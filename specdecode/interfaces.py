"""Proposals and scores, and the two one-method interfaces (vLLM 0.4.2 `spec_decode/interfaces.py`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specdecode.errors import InvalidRequestError
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

    @classmethod
    def none(cls, batch_size: int) -> SpeculativeProposals:
        """No sequence speculates (proposal length 0 for each)."""
        return cls(torch.full((batch_size, 0), -1, dtype=torch.long), None,
                   torch.zeros(batch_size, dtype=torch.long))

    def validate(self, req: ExecuteModelRequest, vocab_size: int, max_model_len: int) -> None:
        """Check proposals a peer sent for step `req` before any tensor op reads them (their
        dtypes and shapes are the wire codec's: ids [B, k], lens [B] in [0, k], probs
        [B, k, V]): k is the request's num_lookahead_slots; inside each sequence's length the
        ids are in the vocabulary and beyond it -1; a sequence with its proposal fits the
        model; probabilities are finite, in [0, 1], and sum to 1 where a sampled sequence
        proposes. InvalidRequestError names the field (proposal_token_ids, ...)."""
        ids, lens = self.proposal_token_ids, self.proposal_lens  # [B, k], [B]
        k = req.num_lookahead_slots
        if ids.shape[1] != k:
            raise InvalidRequestError("proposal_token_ids", f"has {ids.shape[1]} columns, "
                                                            f"num_lookahead_slots is {k}")
        inside = torch.arange(k)[None, :] < lens[:, None]  # [B, k]
        bad = torch.where(inside, (ids < 0) | (ids >= vocab_size), ids != -1)  # [B, k]
        if bad.any():
            i, j = bad.nonzero()[0].tolist()
            raise InvalidRequestError("proposal_token_ids", f"[{i}, {j}] is {int(ids[i, j])}: "
                                      f"within proposal_lens[{i}] = {int(lens[i])} ids are in "
                                      f"[0, {vocab_size}), beyond it -1")
        groups = req.seq_group_metadata_list
        for i, (sg, n) in enumerate(zip(groups, lens.tolist())):
            if sg.data.get_len() + n > max_model_len:
                raise InvalidRequestError("proposal_lens", f"[{i}] = {n}: with its "
                                          f"{sg.data.get_len()} tokens the sequence passes the "
                                          f"max model length {max_model_len}")
        if self.proposal_probs is not None:
            sampled = torch.tensor([not sg.sampling_params.greedy for sg in groups])  # [B]
            _check_probs(self.proposal_probs, inside & sampled[:, None])

    def __repr__(self) -> str:
        probs = None if self.proposal_probs is None else tuple(self.proposal_probs.shape)
        return (f"SpeculativeProposals(proposal_token_ids={self.proposal_token_ids.tolist()}, "
                f"proposal_probs={probs}, proposal_lens={self.proposal_lens.tolist()})")


def _check_probs(probs: torch.Tensor, normalised: torch.Tensor) -> None:
    """probs [B, k, V]: finite and in [0, 1]; the rows where `normalised` [B, k] sum to 1
    (within the rounding of the tensor's dtype). Two passes over the tensor: its extremes
    (NaN and inf fail the range) and its row sums."""
    tolerance = max(1e-3, 4 * torch.finfo(probs.dtype).eps)
    if probs.numel():
        low, high = torch.aminmax(probs)
        if not (float(low) >= 0.0 and float(high) <= 1.0 + tolerance):  # NaN fails both
            raise InvalidRequestError("proposal_probs", "values must be finite and in [0, 1]")
    sums = probs.sum(-1, dtype=torch.float32)[normalised]  # [rows]
    off = (sums - 1.0).abs() > tolerance
    if off.any():
        i, j = normalised.nonzero()[int(off.nonzero()[0])].tolist()
        raise InvalidRequestError("proposal_probs", f"[{i}, {j}] sums to "
                                  f"{float(sums[off][0]):.6g}; a sampled sequence's draft "
                                  "distribution sums to 1")


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
