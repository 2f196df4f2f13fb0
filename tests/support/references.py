"""What the target model alone does, by full recomputation (no cache, no batching): the
references spec-decode output is compared with."""

from __future__ import annotations

import torch

from specdecode.sampling import truncated_probs
from specdecode.sequence import SamplingParams


@torch.inference_mode()
def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits of one unbatched forward."""
    return model(torch.tensor([tokens])).logits[0].float()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Target-only greedy decoding with full recomputation (no cache, no batching)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@torch.inference_mode()
def target_pair_probs(model, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """The target's exact joint p(t1) p(t2 | t1) of a request's first two tokens, under the
    request's truncation (full recomputation: no cache, no batching)."""
    def dist(tokens):
        return truncated_probs(model(torch.tensor([tokens])).logits[0, -1:], params)[0]
    p1, joint = dist(prompt), {}
    for t1 in p1.nonzero().flatten().tolist():
        p2 = dist(prompt + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint
