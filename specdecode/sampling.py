"""From logits to probabilities and tokens under each sequence's own sampling params.

Every control is part of the distribution: the probabilities returned here are the ones the
rejection sampler compares, for the draft and the target alike. The order follows vLLM:
logit_bias, then the penalties (which depend on the tokens before the position: the
prompt, the output so far, and at a draft position the draft tokens before it), then
temperature (or greedy argmax), top-k, top-p, min_p. A grammar's mask (structured output,
specdecode.grammar) sets the logits of the tokens it does not allow to -inf before all of
them: p and q are then the masked, renormalised distributions, and greedy is the argmax over
the allowed tokens. Log-probabilities are the model's own, before any control.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from specdecode.sequence import SamplingParams, SequenceData


def step_generator(params: SamplingParams, position: int, purpose: str) -> torch.Generator | None:
    """A generator for one random draw of a seeded request, or None when unseeded.

    Seeded from (seed, position, purpose) alone, so a draw does not depend on batch mates,
    on which replica serves the step, or on what happened in earlier steps.
    """
    if params.seed is None:
        return None
    digest = hashlib.sha256(f"{params.seed}:{position}:{purpose}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@dataclass
class TokenHistory:
    """The tokens before one row's position: what its penalties look at."""

    token_ids: list[int]  # prompt, then output (draft tokens included)
    prompt_len: int  # token_ids[prompt_len:] are output tokens

    @staticmethod
    def of(data: SequenceData, num_queries: int = 1) -> list[TokenHistory]:
        """The histories of a sequence's last num_queries positions, in order: row j reads
        the tokens up to and including position len - num_queries + j (it predicts the
        token after it), so with proposals appended row j sees the prefix plus
        proposals[:j]."""
        tokens, n = data.get_token_ids(), len(data.prompt_token_ids)
        return [TokenHistory(tokens[:len(tokens) - num_queries + 1 + j], n)
                for j in range(num_queries)]


def processed_logits(logits: torch.Tensor, params: SamplingParams,
                     history: TokenHistory | None) -> torch.Tensor:
    """logits [V] of one row -> float32 logits [V] after logit_bias and the penalties
    (vLLM's formulas: repetition over prompt and output tokens, presence and frequency over
    output tokens). A new tensor; `history` may be None when no penalty is set."""
    logits = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype,
                            device=logits.device)
        logits.index_add_(0, ids, bias)
    if params.has_penalties:
        assert history is not None, "penalties need the token history"
        V = logits.shape[-1]
        tokens = torch.tensor(history.token_ids, dtype=torch.long, device=logits.device)
        if params.repetition_penalty != 1.0:
            seen = tokens.unique()
            x = logits[seen]
            logits[seen] = torch.where(x > 0, x / params.repetition_penalty,
                                       x * params.repetition_penalty)
        counts = torch.bincount(tokens[history.prompt_len:], minlength=V)[:V].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def truncated_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> float32 probs [N, V] after temperature, top-k, top-p and min-p.

    Greedy params give the one-hot of the argmax (the distribution greedy decoding samples).
    Pass logits through `processed_logits` first when the params have bias or penalties.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [N, V]
        drop_sorted = mass_before >= params.top_p  # keep the smallest prefix reaching top_p
        drop_sorted[..., 0] = False  # the top token, even when top_p rounds to 0 in float32
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0.0:
        drop = probs < params.min_p * probs.max(-1, keepdim=True).values  # [N, V]
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _same_truncation(params: list[SamplingParams]) -> list[tuple[list[int], SamplingParams]]:
    """Rows grouped by the settings truncated_probs reads, each with one of its params."""
    groups: dict[tuple, tuple[list[int], SamplingParams]] = {}
    for i, p in enumerate(params):
        key = (p.temperature, p.top_k, p.top_p, p.min_p)
        groups.setdefault(key, ([], p))[0].append(i)
    return list(groups.values())


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """probs [N, V] -> token ids [N], row i drawn with generators[i] (None = global RNG)."""
    rows = [torch.multinomial(p.cpu(), 1, generator=g) for p, g in zip(probs, generators)]
    return torch.cat(rows).to(probs.device) if rows else torch.empty(0, dtype=torch.long)


def sample_logits(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                  purpose: str, want_probs: bool, want_logprobs: bool,
                  histories: list[TokenHistory | None] | None = None,
                  want_confidence: bool = False, allowed: torch.Tensor | None = None):
    """logits [N, V] for N single-query rows -> SamplerOutput.

    Row i draws the token at sequence position positions[i]: the argmax of its processed
    logits when greedy, else a sample from its processed, truncated distribution with that
    request's step generator. histories[i]: the tokens before row i (needed only by rows
    with penalties). allowed: bool [N, V], False = masked out by the row's grammar (None = no
    grammar in the batch). Logprobs are log_softmax of the raw logits. Confidence (a draft's
    early stop, docs/design.md "Adaptive speculation"): the largest probability of the row's
    distribution: of the processed logits' softmax when greedy (the argmax's probability),
    of the truncated distribution when sampled.
    """
    from specdecode.sequence import SamplerOutput

    histories = histories or [None] * len(params)
    controlled = [i for i, p in enumerate(params) if p.logit_bias or p.has_penalties]
    shaped = logits
    if controlled:
        shaped = logits.float().clone()
        for i in controlled:
            shaped[i] = processed_logits(logits[i], params[i], histories[i])
    if allowed is not None:  # [N, V]
        masked = shaped.float().masked_fill(~allowed.to(shaped.device), float("-inf"))
        # A pruned draft head (proposer_svc.pruned_head) may score none of the allowed
        # tokens: that row drafts unmasked (any q stays exact); a target's never is.
        scored = torch.isfinite(masked).any(-1, keepdim=True)  # [N, 1]
        shaped = torch.where(scored, masked, shaped.float())
    token_ids = shaped.argmax(-1)  # [N]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    probs = None
    if sampled or want_probs:
        probs = torch.empty(shaped.shape, dtype=torch.float32, device=shaped.device)
        for rows, p in _same_truncation(params):  # one batched call per distinct setting
            probs[rows] = truncated_probs(shaped[rows], p)
        if sampled:
            gens = [step_generator(params[i], positions[i], purpose) for i in sampled]
            token_ids[sampled] = sample(probs[sampled], gens)
    logprobs = torch.log_softmax(logits.float(), -1) if want_logprobs else None
    confidence = None
    if want_confidence:  # [N]
        confidence = torch.empty(len(params), dtype=torch.float32, device=shaped.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            confidence[greedy] = torch.softmax(shaped[greedy].float(), -1).amax(-1)
        if sampled:
            confidence[sampled] = probs[sampled].amax(-1)
    return SamplerOutput(sampled_token_ids=token_ids,
                         sampled_token_probs=probs if want_probs else None,
                         logprobs=logprobs, confidence=confidence)
