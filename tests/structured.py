"""Structured-output test helpers: tiny random models over a byte-level tokenizer (a grammar
needs a tokenizer; 257 ids keep the models tiny), and the target's own constrained decoding
computed the slow, obvious way (full recomputation, a fresh matcher per position)."""

from __future__ import annotations

import functools

import torch

from specdecode.grammar.compiler import GrammarCompiler
from specdecode.grammar.matcher import SequenceMatcher, bitmask_to_allowed
from specdecode.grammar.spec import StructuredOutput
from specdecode.sampling import truncated_probs
from specdecode.sequence import SamplingParams
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model, byte_tokenizer

VOCAB = 257  # bytes and <eos>
EOS = 256
TARGET = TinyModelSpec(seed=1, vocab_size=VOCAB)
DRAFT = TinyModelSpec(seed=2, vocab_size=VOCAB, num_layers=1)


@functools.cache
def tokenizer():
    return byte_tokenizer()


@functools.cache
def compiler() -> GrammarCompiler:
    return GrammarCompiler(tokenizer(), VOCAB)


@functools.cache
def tiny(spec: TinyModelSpec):
    return build_tiny_model(spec)


def allowed_after(so: StructuredOutput, output: list[int]) -> torch.Tensor:
    """bool [V]: what the grammar allows after `output` (a fresh matcher)."""
    m = SequenceMatcher(so, compiler().matcher(so), EOS, VOCAB)
    assert m.sync(output), f"{output} is not a prefix the grammar allows"
    return bitmask_to_allowed(m.bitmask()[None], VOCAB)[0]


@torch.inference_mode()
def masked_logits(model, prompt: list[int], output: list[int], so: StructuredOutput):
    logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
    return logits.masked_fill(~allowed_after(so, output), float("-inf"))


def reference_greedy(model, prompt: list[int], so: StructuredOutput, max_tokens: int) -> list[int]:
    """The target alone, greedy under the grammar, to <eos> or max_tokens."""
    out: list[int] = []
    while len(out) < max_tokens and (not out or out[-1] != EOS):
        out.append(int(masked_logits(model, prompt, out, so).argmax()))
    return out


def masked_pair_probs(model, prompt: list[int], so: StructuredOutput,
                      params: SamplingParams) -> dict[tuple, float]:
    """The target's exact joint p(t1) p(t2 | t1) under the grammar and the truncation (a
    first token <eos> ends the request: the pair is then (t1,))."""
    def dist(output):
        return truncated_probs(masked_logits(model, prompt, output, so)[None], params)[0]
    p1, joint = dist([]), {}
    for t1 in p1.nonzero().flatten().tolist():
        if t1 == EOS:
            joint[(t1,)] = float(p1[t1])
            continue
        p2 = dist([t1])
        for t2 in p2.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint
