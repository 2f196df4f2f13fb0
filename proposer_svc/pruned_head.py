"""A cheaper draft head (frequency-ranked vocabulary, after FR-Spec, 2025): the draft model
computes logits only for its N most frequent tokens and leaves every other token at -inf.

The draft's distribution q is then zero outside the subset. Rejection sampling needs only
that q is the distribution the draft token was drawn from, so it stays exact; under greedy
decoding the draft's argmax within the subset is just a different proposal, and the target
decides what is emitted. The LM head of Qwen2.5-0.5B is 151,936 x 896; at N = 32,768 the
matmul shrinks 4.6x (docs/benchmarks.md has the measured forward times).

Which tokens are frequent: the tokenizer's own BPE merge ranks. A byte-level BPE learns
its merges greedily by pair frequency on its training corpus, so the token made by an early
merge is a frequent one; the 256 byte tokens and every added/special token (EOS,
chat-template markers) are always kept. This needs no corpus in the package and follows
each tokenizer's own training data. A model without a BPE tokenizer.json keeps the N
lowest ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


def frequency_order(model_dir: str | Path | None, vocab_size: int) -> list[int]:
    """All token ids [0, vocab_size), most frequent first (see the module docstring)."""
    path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    if path is None or not path.exists():
        return list(range(vocab_size))
    spec = json.loads(path.read_text())
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        return list(range(vocab_size))
    vocab: dict[str, int] = model["vocab"]
    rank: dict[int, float] = {i: -1.0 for i in (t["id"] for t in spec.get("added_tokens", []))}
    for i, merge in enumerate(model.get("merges", [])):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        token_id = vocab.get(a + b)
        if token_id is not None and token_id not in rank:
            rank[token_id] = i + 1.0
    for token_id in vocab.values():  # the byte alphabet: no merge made them
        rank.setdefault(token_id, 0.0)
    # Ids no tokenizer entry names (the padded rows of a model's embedding) go last.
    return sorted(range(vocab_size), key=lambda t: (rank.get(t, float("inf")), t))


class PrunedLMHead(nn.Module):
    """Drop-in for a model's `lm_head` (nn.Linear hidden -> V): logits for the kept ids,
    -inf elsewhere. keep: [N] long, ascending. The kept rows form a linear of the head's own
    class (a row-invariant head stays row-invariant: specdecode.executor.invariant_ops)."""

    def __init__(self, lm_head: nn.Linear, keep: torch.Tensor):
        super().__init__()
        weight = lm_head.weight
        self.vocab_size = weight.shape[0]
        self.register_buffer("keep", keep.to(weight.device))
        self.proj = type(lm_head)(weight.shape[1], len(keep), bias=lm_head.bias is not None,
                                  device="meta")
        self.proj.weight = nn.Parameter(weight.detach()[self.keep].clone(), requires_grad=False)
        if lm_head.bias is not None:
            self.proj.bias = nn.Parameter(lm_head.bias.detach()[self.keep].clone(),
                                          requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = self.proj(hidden)  # [..., N]
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        return full.index_copy_(-1, self.keep, sub)


def prune_lm_head(model: nn.Module, model_dir: str | Path | None, vocab_subset: int) -> int:
    """Replace model.lm_head by a PrunedLMHead over its `vocab_subset` most frequent ids
    (0 or >= the vocabulary: leave the head alone). Returns how many ids the head scores."""
    head = model.get_output_embeddings()
    vocab_size = head.weight.shape[0]
    if vocab_subset <= 0 or vocab_subset >= vocab_size:
        return vocab_size
    order = frequency_order(model_dir, vocab_size)
    specials = {t for t in (model.config.eos_token_id, model.config.bos_token_id,
                            getattr(model.config, "pad_token_id", None)) if t is not None}
    specials = {t for s in specials for t in (s if isinstance(s, list) else [s])}
    keep = sorted(set(order[:vocab_subset]) | {t for t in specials if 0 <= t < vocab_size})
    model.lm_head = PrunedLMHead(head, torch.tensor(keep, dtype=torch.long))
    return len(keep)
