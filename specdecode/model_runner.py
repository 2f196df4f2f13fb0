"""Runs a batch of sequences of different lengths through a transformers causal LM in one
forward pass, with a KV cache per sequence id.

Stateless semantics, cached execution (docs/design.md, invariant 3): every row carries its
full token ids; the cache only saves work. A row reuses the longest prefix its cache entry shares with
its tokens (a rollback when proposals were rejected), and recomputes everything on a miss.

Batch layout, for row i with `past_i` cached and `n_i` new tokens, P = max past, N = max new:

    keys:   [ pad (P - past_i) | cached past_i | new n_i | pad (N - n_i) ]
    mask:   [       0          |      1        |    1    |       0       ]

Past is left-padded and new tokens right-padded, so every query (pads included) sees at
least one real key, and causal masking keeps real queries off the right padding.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from opentelemetry import trace
from transformers import DynamicCache


@dataclass
class RunnerRow:
    """One sequence to run: its full tokens and which KV cache entry it may read."""

    cache_id: int
    token_ids: list[int]
    num_queries: int  # logits are returned for the last num_queries positions


@dataclass
class _CacheEntry:
    token_ids: list[int]
    keys: torch.Tensor  # [layers, heads, len, head_dim]: all layers in one tensor, so a
    values: torch.Tensor  # row costs one copy per forward, not one per layer


@dataclass
class RunnerStats:
    """Counters a service exports: cache hits/misses and work done."""

    cache_hits: int = 0  # rows that reused a cached prefix
    cache_misses: int = 0  # rows computed from scratch
    tokens_computed: int = 0  # tokens fed to the model
    forward_calls: int = 0
    forward_seconds: float = 0.0


@dataclass(frozen=True)
class ForwardStats:
    """One forward pass, as handed to ModelRunner.on_forward (service metrics)."""

    batch_size: int  # rows
    tokens_computed: int  # new tokens fed to the model
    cache_hits: int
    cache_misses: int
    seconds: float


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ModelRunner:
    def __init__(self, model, device: torch.device, max_model_len: int | None = None,
                 max_cached_sequences: int = 1024):
        self.model = model
        self.device = device
        self.vocab_size: int = model.config.vocab_size
        self.max_model_len: int = min(max_model_len or 1 << 62,
                                      model.config.max_position_embeddings)
        self.max_cached_sequences = max_cached_sequences
        self._cache: OrderedDict[int, _CacheEntry] = OrderedDict()
        self.stats = RunnerStats()
        # Called after every forward pass (e.g. to observe Prometheus histograms).
        self.on_forward: Callable[[ForwardStats], None] | None = None

    @property
    def num_cached_sequences(self) -> int:
        return len(self._cache)

    def release(self, cache_ids: list[int]) -> int:
        """Drop cache entries; returns how many existed."""
        return sum(self._cache.pop(i, None) is not None for i in cache_ids)

    def _cached_len(self, row: RunnerRow) -> int:
        entry = self._cache.get(row.cache_id)
        if entry is None:
            return 0
        # Query positions must be recomputed: the cache holds keys/values, not logits.
        return min(_common_prefix_len(entry.token_ids, row.token_ids),
                   len(row.token_ids) - row.num_queries)

    @torch.inference_mode()
    def forward(self, rows: list[RunnerRow]) -> list[torch.Tensor]:
        """Returns, per row, float32 logits [num_queries, V] for its last positions."""
        if not rows:
            return []
        for row in rows:
            if not 1 <= row.num_queries <= len(row.token_ids):
                raise ValueError(f"num_queries: {row.num_queries} not in [1, {len(row.token_ids)}]")
        start = time.perf_counter()
        past = [self._cached_len(r) for r in rows]  # [B]
        new = [len(r.token_ids) - p for r, p in zip(rows, past)]  # [B]
        B, P, N = len(rows), max(past), max(new)

        input_ids = torch.zeros(B, N, dtype=torch.long)
        attention_mask = torch.zeros(B, P + N, dtype=torch.long)
        position_ids = torch.zeros(B, N, dtype=torch.long)
        for i, (row, p, n) in enumerate(zip(rows, past, new)):
            input_ids[i, :n] = torch.tensor(row.token_ids[p:], dtype=torch.long)
            attention_mask[i, P - p:P + n] = 1
            position_ids[i] = torch.arange(p, p + N)
        cache = DynamicCache(self._stack_past(rows, past, P)) if P else DynamicCache()

        out = self.model(input_ids=input_ids.to(self.device),
                         attention_mask=attention_mask.to(self.device),
                         position_ids=position_ids.to(self.device),
                         cache=cache, use_cache=True)
        logits = out.logits.float()  # [B, N, V]
        results = [logits[i, n - r.num_queries:n] for i, (r, n) in enumerate(zip(rows, new))]

        self._store(rows, past, new, P, cache)
        hits, computed = sum(p > 0 for p in past), sum(new)
        seconds = time.perf_counter() - start
        self.stats.cache_hits += hits
        self.stats.cache_misses += B - hits
        self.stats.tokens_computed += computed
        self.stats.forward_calls += 1
        self.stats.forward_seconds += seconds
        span = trace.get_current_span()  # the caller's forward span, when traced
        if span.is_recording():
            span.set_attributes({"specdecode.forward.rows": B,
                                 "specdecode.forward.tokens_computed": computed,
                                 "specdecode.forward.cached_tokens": sum(past),
                                 "specdecode.kv_cache.hits": hits,
                                 "specdecode.kv_cache.misses": B - hits})
        if self.on_forward is not None:
            self.on_forward(ForwardStats(B, computed, hits, B - hits, seconds))
        return results

    def _stack_past(self, rows: list[RunnerRow], past: list[int], P: int):
        """Per layer: cached keys/values of every row, left-padded to P. [B, heads, P, dim]"""
        template = self._cache[next(r.cache_id for r, p in zip(rows, past) if p)].keys
        L, H, _, D = template.shape
        keys = template.new_zeros(L, len(rows), H, P, D)
        values = template.new_zeros(L, len(rows), H, P, D)
        for i, (row, p) in enumerate(zip(rows, past)):
            if p:
                entry = self._cache[row.cache_id]
                keys[:, i, :, P - p:] = entry.keys[:, :, :p]
                values[:, i, :, P - p:] = entry.values[:, :, :p]
        return list(zip(keys.unbind(0), values.unbind(0)))

    def _store(self, rows, past, new, P, cache) -> None:
        """Per cache id, keep the keys/values of its longest row: rows sharing a cache id
        (batch expansion) are prefixes of one another, and the next step's request rolls
        the entry back to what it shares."""
        longest: dict[int, int] = {}
        for i, row in enumerate(rows):
            j = longest.get(row.cache_id)
            if j is None or len(row.token_ids) > len(rows[j].token_ids):
                longest[row.cache_id] = i
        keys = torch.stack([layer.keys for layer in cache.layers])  # [L, B, heads, P+N, dim]
        values = torch.stack([layer.values for layer in cache.layers])
        for cache_id, i in longest.items():
            p, n = past[i], new[i]
            self._cache[cache_id] = _CacheEntry(list(rows[i].token_ids),
                                                keys[:, i, :, P - p:P + n].clone(),
                                                values[:, i, :, P - p:P + n].clone())
            self._cache.move_to_end(cache_id)
        while len(self._cache) > self.max_cached_sequences:
            self._cache.popitem(last=False)
