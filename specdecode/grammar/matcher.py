"""Each constrained sequence's grammar state, next to the logits it masks.

A service (or the orchestrator) keeps one SequenceMatcher per sequence id, like its KV
cache: synced every step to the tokens the row reads (the longest common prefix is kept,
the rest rolled back, the new tokens consumed: a rejection is a rollback), rebuilt from the
compiled grammar when absent. Correctness never depends on what was kept: the state is a
function of the output tokens alone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from opentelemetry import trace

from specdecode.grammar.compiler import GrammarCompiler
from specdecode.grammar.spec import StructuredOutput
from specdecode.sequence import SequenceGroupMetadata

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_to_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [N, W] (bit b of word w = token 32w + b) -> bool [N, V], True = allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [N, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SequenceMatcher:
    """One sequence's grammar state over its output tokens."""

    def __init__(self, so: StructuredOutput, matcher, eos_token_id: int, vocab_size: int):
        self.so = so
        self._m = matcher  # llguidance.LLMatcher
        self._eos = eos_token_id
        self._width = (vocab_size + 31) // 32
        self.tokens: list[int] = []  # consumed: every one allowed, no end-of-sequence
        self._bitmask: torch.Tensor | None = None  # [W] of the current state, once computed

    def sync(self, output: list[int]) -> bool:
        """Move to the state after `output` (rolling back what differs from the tokens held).
        False when the grammar does not allow all of it (a draft's disallowed token) or it
        holds an end-of-sequence: what follows is then no position the grammar has."""
        n = _common_prefix_len(self.tokens, output)
        if n < len(self.tokens):
            self._m.rollback(len(self.tokens) - n)
            del self.tokens[n:]
            self._bitmask = None
        rest = output[n:]
        usable = rest.index(self._eos) if self._eos in rest else len(rest)
        if usable:
            consumed = self._m.try_consume_tokens(rest[:usable])
            if consumed:
                self.tokens += rest[:consumed]
                self._bitmask = None
            usable = consumed
        if self._m.is_error():
            raise RuntimeError(f"grammar matcher failed: {self._m.get_error()}")
        return usable == len(rest)

    def bitmask(self) -> torch.Tensor:
        """int32 [W]: the tokens the grammar allows next (only end-of-sequence once the
        grammar is complete)."""
        if self._bitmask is None:
            out = torch.empty(self._width, dtype=torch.int32)
            # What llguidance.torch.fill_next_token_bitmask does (that module compiles a
            # kernel at import, seconds we do not need): fill the buffer in native code.
            self._m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
            self._bitmask = out
        return self._bitmask

    def forced_token(self) -> int | None:
        """The one token the grammar allows next, or None when it allows several."""
        words = self.bitmask().nonzero().flatten()
        if len(words) != 1:
            return None
        word = int(self.bitmask()[words[0]]) & 0xFFFFFFFF
        if word & (word - 1):  # more than one bit
            return None
        return int(words[0]) * 32 + word.bit_length() - 1


@dataclass
class MaskStats:
    """Counters a service exports: masks computed and the time they took."""

    masks: int = 0
    seconds: float = 0.0
    forced: int = 0  # positions filled without a forward (jump-forward)


class Grammars:
    """The grammar states a service (or the orchestrator) holds, by sequence id."""

    def __init__(self, compiler: GrammarCompiler, max_sequences: int = 4096):
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.max_sequences = max_sequences
        self._matchers: OrderedDict[int, SequenceMatcher] = OrderedDict()
        self.stats = MaskStats()

    def matcher(self, key: int, so: StructuredOutput, field: str | None = None) -> SequenceMatcher:
        """The state of sequence `key` under `so` (a new one when absent or for another
        spec); InvalidRequestError naming `field` when `so` does not compile."""
        m = self._matchers.get(key)
        if m is None or m.so != so:
            m = SequenceMatcher(so, self.compiler.matcher(so, field),
                                self.compiler.eos_token_id, self.vocab_size)
            self._matchers[key] = m
            while len(self._matchers) > self.max_sequences:
                self._matchers.popitem(last=False)
        self._matchers.move_to_end(key)
        return m

    def compile_all(self, groups: list[SequenceGroupMetadata], field: str) -> None:
        """Compile every group's spec (InvalidRequestError naming `field`[i]...), so that
        later calls on these groups only hit the cache."""
        for i, sg in enumerate(groups):
            so = sg.sampling_params.structured_output
            if so is not None:
                self.compiler.matcher(so, f"{field}[{i}].sampling_params.{so.field}")

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self._matchers.pop(key, None)

    def row_masks(self, groups: list[SequenceGroupMetadata],
                  num_queries: list[int]) -> torch.Tensor | None:
        """bool [N, V] for the N = sum(num_queries) rows of a forward (row (i, j) predicts
        the token after the first len_i - q_i + j + 1 tokens of group i, as in
        ModelWorker.score_rows), True = allowed; None when no group is constrained. Rows
        of unconstrained groups, and rows past a disallowed draft token, allow everything."""
        if not any(sg.sampling_params.structured_output for sg in groups):
            return None
        start, masks_before = time.perf_counter(), self.stats.masks
        bitmask = torch.full((sum(num_queries), (self.vocab_size + 31) // 32), -1,
                             dtype=torch.int32)  # [N, W]
        row = 0
        for sg, q in zip(groups, num_queries):
            so = sg.sampling_params.structured_output
            if so is not None:
                m = self.matcher(sg.kv_cache_id, so)
                out = sg.data.output_token_ids
                for j in range(q):
                    if m.sync(out[:len(out) - (q - 1 - j)]):
                        bitmask[row + j] = m.bitmask()
                        self.stats.masks += 1
            row += q
        seconds, masks = time.perf_counter() - start, self.stats.masks - masks_before
        self.stats.seconds += seconds
        span = trace.get_current_span()  # the caller's forward span, when traced
        if span.is_recording():
            span.set_attributes({"specdecode.grammar.masks": masks,
                                 "specdecode.grammar.mask_seconds": seconds})
        return bitmask_to_allowed(bitmask, self.vocab_size)

    def forced_tokens(self, groups: list[SequenceGroupMetadata]) -> list[int | None]:
        """Per group: the one token its grammar allows after its tokens, or None (also for
        unconstrained groups and past a disallowed token)."""
        out: list[int | None] = []
        for sg in groups:
            so = sg.sampling_params.structured_output
            token = None
            if so is not None:
                m = self.matcher(sg.kv_cache_id, so)
                if m.sync(sg.data.output_token_ids):
                    token = m.forced_token()
            out.append(token)
        return out
