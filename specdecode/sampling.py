"""From logits to probabilities and tokens under each sequence's own sampling params.

Truncation (top-k, top-p) is part of the distribution: the probabilities returned here are
the ones the rejection sampler compares, for the draft and the target alike.
"""

from __future__ import annotations

import hashlib

import torch

from specdecode.sequence import SamplingParams


def step_generator(params: SamplingParams, position: int, purpose: str) -> torch.Generator | None:
    """A generator for one random draw of a seeded request, or None when unseeded.

    Seeded from (seed, position, purpose) alone, so a draw does not depend on batch mates,
    on which replica serves the step, or on what happened in earlier steps.
    """
    if params.seed is None:
        return None
    digest = hashlib.sha256(f"{params.seed}:{position}:{purpose}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def truncated_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> float32 probs [N, V] after temperature, top-k and top-p.

    Greedy params give the one-hot of the argmax (the distribution greedy decoding samples).
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
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """probs [N, V] -> token ids [N], row i drawn with generators[i] (None = global RNG)."""
    rows = [torch.multinomial(p.cpu(), 1, generator=g) for p, g in zip(probs, generators)]
    return torch.cat(rows).to(probs.device) if rows else torch.empty(0, dtype=torch.long)


def sample_logits(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                  purpose: str, want_probs: bool, want_logprobs: bool):
    """logits [N, V] for N single-query rows -> SamplerOutput.

    Row i draws the token at sequence position positions[i]: argmax when greedy, else a
    sample from its truncated distribution with that request's step generator.
    """
    from specdecode.sequence import SamplerOutput

    token_ids = logits.argmax(-1)  # [N]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    probs = None
    if sampled or want_probs:
        probs = torch.stack([truncated_probs(row[None], p)[0] for row, p in zip(logits, params)])
        if sampled:
            gens = [step_generator(params[i], positions[i], purpose) for i in sampled]
            token_ids[sampled] = sample(probs[sampled], gens)
    logprobs = torch.log_softmax(logits.float(), -1) if want_logprobs else None
    return SamplerOutput(sampled_token_ids=token_ids,
                         sampled_token_probs=probs if want_probs else None,
                         logprobs=logprobs)
