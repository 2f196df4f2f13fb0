"""Runs a batch of sequences of different lengths through a transformers causal LM in one
forward pass, over a KV cache pool allocated once from a memory budget.

Stateless semantics, cached execution (docs/design.md, invariant 3): every row carries its
full token ids; the pool only saves work. A row reuses the longest prefix its pool entry shares with its
tokens (after a rejection that is a rollback: the entry's length is cut) and recomputes
everything on a miss or after its entry was evicted. Rows that share a cache id (batch
expansion) are prefixes of one another: the longest writes the new keys/values, and every
row attends over the same pool slots. A batch whose sequences do not fit in the pool together
runs in parts; a request never fails for lack of cache.

Two paths (docs/design.md, Executor):
- fast (Llama, Qwen2): `LlamaLikeForward` packs the batch's new tokens, writes keys/values into
  the pool in place and attends over the pool through an `AttentionBackend` (no copy of the past);
- generic (any other causal LM): the model's own forward over a DynamicCache built from the
  pool (left-padded past, right-padded new tokens), whose new keys/values are then written back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

import torch
from opentelemetry import trace
from transformers import DynamicCache

from specdecode.executor.attention import (AttentionBackend, AttnBatch, InvariantSdpaBackend,
                                           SdpaBackend, select_backend)
from specdecode.executor.compiled_forward import BATCH_BUCKETS, CompiledForwards
from specdecode.executor.fast_forward import LlamaLikeForward, fast_path_unsupported
from specdecode.executor.invariant_ops import make_row_invariant
from specdecode.executor.kv_pool import KVPool, PoolEntry, PoolFull
from specdecode.executor.static_attention import STATIC_BACKENDS

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 2 << 30  # bytes, when no budget is given (capped by the need below)
DEFAULT_MAX_NUM_SEQS = 256


@dataclass
class RunnerRow:
    """One sequence to run: its full tokens and which KV cache entry it may read."""

    cache_id: int
    token_ids: list[int]
    num_queries: int  # logits are returned for the last num_queries positions


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


@dataclass
class _Plan:
    """One forward's batch, laid out over the pool."""

    rows: list[RunnerRow]
    past: list[int]  # [B] tokens read from the pool (not recomputed)
    starts: list[int]  # [B] first pool slot of each row's entry
    writes: list[bool]  # [B] whether the row writes its new keys/values (owns its entry)
    entries: dict[int, tuple[PoolEntry, list[int]]]  # cache id -> (entry, owner's tokens)
    temporary: list[int]  # private cache ids to release after the forward


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def kv_geometry(model) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a causal LM, read from one cached forward pass, so
    that any model with a uniform DynamicCache is covered."""
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), cache=cache,
              use_cache=True)
    shapes = {tuple(layer.keys.shape[1::2]) for layer in cache.layers}
    if len(shapes) != 1:
        raise ValueError(f"model: layers with different KV shapes {sorted(shapes)} are not "
                         "supported by the KV pool")
    ((heads, dim),) = shapes
    return len(cache.layers), heads, dim


def pool_tokens(kv_cache_memory: int | None, max_num_seqs: int, max_len: int,
                bytes_per_token: int, block: int) -> int:
    """Tokens the KV pool holds: the budget (default: what max_num_seqs sequences of max_len
    need, at most DEFAULT_KV_CACHE_MEMORY) in whole blocks; at least one block."""
    budget = kv_cache_memory or min(DEFAULT_KV_CACHE_MEMORY,
                                    max_num_seqs * max_len * bytes_per_token)
    tokens = budget // bytes_per_token // block * block
    if tokens < block:
        raise ValueError(f"kv_cache_memory: {budget} bytes hold less than one block of "
                         f"{block} tokens ({bytes_per_token} bytes per token)")
    if tokens < max_len:
        log.warning("max_model_len %d cut to %d: the KV cache budget (%d bytes) holds no "
                    "more", max_len, tokens, budget)
    return tokens


class ModelRunner:
    def __init__(self, model, device: torch.device, max_model_len: int | None = None,
                 kv_cache_memory: int | None = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 enforce_eager: bool | None = None, backend: AttentionBackend | None = None,
                 fast_path: bool = True, deterministic: bool = False,
                 static_attention: str | None = None,
                 compile_batch_sizes: tuple[int, ...] | None = None, compile_now: bool = True):
        """enforce_eager: None = the device's default (compiled forwards on an accelerator,
        eager on CPU: docs/benchmarks.md, *Compiled forwards*); compile_now False: the
        compiled forwards are built but compiled later (`compiled.compile`, from another
        thread: specdecode.executor.compile_mode), the forwards eager until each graph is
        ready; static_attention: the compiled forwards' backend
        (static_attention.STATIC_BACKENDS; None: flex on CUDA, padded SDPA elsewhere: on CPU
        it measured faster than flex)."""
        self.model = model
        self.device = device
        self.vocab_size: int = model.config.vocab_size
        why_not = fast_path_unsupported(model) if fast_path else "disabled"
        self.fast = LlamaLikeForward(model) if why_not is None else None
        dtype = next(model.parameters()).dtype
        # Row-invariant numerics need the fast path's attention (docs/design.md).
        self.deterministic = deterministic and self.fast is not None
        if deterministic and not self.fast:
            log.warning("deterministic: not available on the generic path (%s); a row's "
                        "numbers may depend on its batch", why_not)
        if self.deterministic:
            make_row_invariant(model)
            backend = backend or InvariantSdpaBackend()
        # The generic path builds DynamicCaches from the pool's [layers, 2, heads, tokens, dim].
        self.backend = (backend or select_backend(device, dtype)) if self.fast else SdpaBackend()
        if self.fast:
            layers, heads, dim = len(self.fast.layers), self.fast.num_kv_heads, self.fast.head_dim
        else:
            layers, heads, dim = kv_geometry(model)
        bytes_per_token = layers * 2 * heads * dim * dtype.itemsize
        max_len = min(max_model_len or 1 << 62, model.config.max_position_embeddings)
        block = self.backend.block_size
        tokens = pool_tokens(kv_cache_memory, max_num_seqs, max_len, bytes_per_token, block)
        self.max_model_len: int = min(max_len, tokens)
        self.compiled: CompiledForwards | None = None
        why_eager = self._why_eager(enforce_eager, device)
        # Compiled, one scratch block past the pool's own is where padding rows go.
        kv = self.backend.allocate(layers, heads, tokens + block * (why_eager is None), dim,
                                   dtype, device)
        self.pool = KVPool(kv.narrow(self.backend.token_dim, 0, tokens), self.backend.token_dim,
                           block, max_num_seqs)
        self.bytes_per_token = bytes_per_token
        self._temporary_ids = count(-1, -1)
        self.stats = RunnerStats()
        # Called after every forward pass (e.g. to observe Prometheus histograms).
        self.on_forward: Callable[[ForwardStats], None] | None = None
        log.info("model runner: %s path%s, %s numerics, attention %s, KV pool %.1f MiB = %d "
                 "tokens (%d bytes each), max %d sequences, max_model_len %d",
                 "fast" if self.fast else "generic", "" if self.fast else f" ({why_not})",
                 "row-invariant" if self.deterministic else "batch-dependent",
                 self.backend.name, self.pool.nbytes / 2**20, tokens, bytes_per_token,
                 max_num_seqs, self.max_model_len)
        if why_eager is None:
            buckets = compile_batch_sizes or tuple(b for b in BATCH_BUCKETS if b <= max_num_seqs)
            self.compiled = self._compiled(kv, tokens // block, buckets, static_attention)
            if compile_now:
                self.compiled.compile()
        else:
            log.info("model runner: eager forwards (%s)", why_eager)

    def _compiled(self, kv: torch.Tensor, blocks: int, buckets: tuple[int, ...],
                  static_attention: str | None) -> CompiledForwards:
        """The compiled forwards over `kv` (the pool and its scratch block), none compiled."""
        name = static_attention or ("flex" if self.device.type == "cuda" else "sdpa-padded")
        return CompiledForwards(self.fast, kv, STATIC_BACKENDS[name](self.backend.token_dim),
                                blocks, self.backend.block_size, self.device, buckets)

    def _why_eager(self, enforce_eager: bool | None, device: torch.device) -> str | None:
        """Why the forwards stay eager, or None when they are compiled."""
        if enforce_eager or (enforce_eager is None and device.type == "cpu"):
            return "--enforce-eager" if enforce_eager else "the CPU default"
        if self.fast is None:
            return "compiled forwards need the fast path"
        if self.deterministic:
            return "--deterministic on has its own attention"
        return None

    @property
    def num_cached_sequences(self) -> int:
        return self.pool.num_sequences

    @property
    def max_cached_sequences(self) -> int:
        return self.pool.max_num_seqs

    def fits(self, rows: dict[int, int]) -> bool:
        """Whether cache entries of rows[cache_id] tokens fit with nothing evicted."""
        return self.pool.fits(rows)

    def release(self, cache_ids: list[int]) -> int:
        """Drop cache entries; returns how many existed."""
        return self.pool.release(cache_ids)

    @torch.inference_mode()
    def forward(self, rows: list[RunnerRow]) -> list[torch.Tensor]:
        """Returns, per row, float32 logits [num_queries, V] for its last positions."""
        if not rows:
            return []
        for row in rows:
            if not 1 <= row.num_queries <= len(row.token_ids):
                raise ValueError(f"num_queries: {row.num_queries} not in [1, {len(row.token_ids)}]")
            if len(row.token_ids) > self.max_model_len:
                raise ValueError(f"token_ids: {len(row.token_ids)} tokens exceed max_model_len "
                                 f"{self.max_model_len}")
        start = time.perf_counter()
        results, past = self._forward_fitting(rows)
        hits, computed = sum(p > 0 for p in past), sum(len(r.token_ids) - p
                                                       for r, p in zip(rows, past))
        seconds = time.perf_counter() - start
        B = len(rows)
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

    def _forward_fitting(self, rows: list[RunnerRow]) -> tuple[list[torch.Tensor], list[int]]:
        """One forward when the batch fits in the pool, else halves of it in turn."""
        try:
            plan = self._plan(rows)
        except PoolFull:
            if len(rows) == 1:
                raise ValueError(f"token_ids: {len(rows[0].token_ids)} tokens do not fit in "
                                 "the KV cache pool") from None
            half = len(rows) // 2
            a, pa = self._forward_fitting(rows[:half])
            b, pb = self._forward_fitting(rows[half:])
            return a + b, pa + pb
        try:
            logits = self._run_fast(plan) if self.fast else self._run_generic(plan)
            for entry, tokens in plan.entries.values():
                entry.token_ids[:] = tokens
        finally:
            self.pool.release(plan.temporary)
        return logits, plan.past

    def _plan(self, rows: list[RunnerRow]) -> _Plan:
        """Group rows by cache id (the longest row owns the entry; a row that is not its
        prefix gets a private one), cut each entry to what it shares with its owner, and
        reserve room for the owner's tokens."""
        ids = [r.cache_id for r in rows]
        owner: dict[int, int] = {}
        for i, row in enumerate(rows):
            j = owner.get(row.cache_id)
            if j is None or len(row.token_ids) > len(rows[j].token_ids):
                owner[row.cache_id] = i
        temporary = []
        for i, row in enumerate(rows):
            own = rows[owner[row.cache_id]].token_ids
            if i != owner[row.cache_id] and row.token_ids != own[:len(row.token_ids)]:
                ids[i] = next(self._temporary_ids)
                owner[ids[i]] = i
                temporary.append(ids[i])
        pinned = set(ids)
        kept: dict[int, int] = {}
        entries: dict[int, tuple[PoolEntry, list[int]]] = {}
        try:
            for cache_id, i in owner.items():
                tokens = rows[i].token_ids
                entry = self.pool.get(cache_id)
                valid = _common_prefix_len(entry.token_ids, tokens) if entry else 0
                keep = min(valid, len(tokens) - rows[i].num_queries)
                entry = self.pool.reserve(cache_id, len(tokens), keep, pinned)
                kept[cache_id] = len(entry.token_ids)
                entries[cache_id] = (entry, list(tokens))
        except PoolFull:
            self.pool.release(temporary)
            raise
        past = [min(kept[c], len(r.token_ids) - r.num_queries) for c, r in zip(ids, rows)]
        return _Plan(rows, past, [entries[c][0].start for c in ids],
                     [owner[c] == i for i, c in enumerate(ids)], entries, temporary)

    def _run_fast(self, plan: _Plan) -> list[torch.Tensor]:
        input_ids, positions, query_index, slots, written = [], [], [], [], []
        q_starts, kv_lens = [0], []
        for row, p, s, w in zip(plan.rows, plan.past, plan.starts, plan.writes):
            n, L = len(row.token_ids) - p, len(row.token_ids)
            input_ids += row.token_ids[p:]
            positions += range(p, L)
            query_index += range(q_starts[-1] + n - row.num_queries, q_starts[-1] + n)
            if w:
                slots += range(s + p, s + L)
                written += range(q_starts[-1], q_starts[-1] + n)
            q_starts.append(q_starts[-1] + n)
            kv_lens.append(L)
        q = plan.rows[0].num_queries
        if self.compiled and self.compiled.fits(len(plan.rows), q) and all(plan.writes) and all(
                r.num_queries == q and len(r.token_ids) - p == q
                for r, p in zip(plan.rows, plan.past)):
            logits = self.compiled.run(input_ids, positions, slots, plan.starts, kv_lens, q)
            return list(logits.split([q] * len(plan.rows)))
        dev = self.device
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        batch = AttnBatch(q_starts, plan.starts, kv_lens, as_long(slots),
                          None if len(written) == q_starts[-1] else as_long(written))
        self.backend.prepare(batch, self.fast.num_heads // self.fast.num_kv_heads, dev)
        logits = self.fast(as_long(input_ids), as_long(positions), as_long(query_index),
                           self.pool.kv, self.backend, batch)  # [Q, V]
        return list(logits.split([r.num_queries for r in plan.rows]))

    def _run_generic(self, plan: _Plan) -> list[torch.Tensor]:
        """Keys [pad (P - past_i) | cached past_i | new n_i | pad (N - n_i)], mask 0/1/1/0:
        every query sees at least one real key; causal masking keeps real queries off the
        right padding."""
        rows, past, kv = plan.rows, plan.past, self.pool.kv
        new = [len(r.token_ids) - p for r, p in zip(rows, past)]
        B, P, N = len(rows), max(past), max(new)
        input_ids = torch.zeros(B, N, dtype=torch.long)
        attention_mask = torch.zeros(B, P + N, dtype=torch.long)
        position_ids = torch.zeros(B, N, dtype=torch.long)
        for i, (row, p, n) in enumerate(zip(rows, past, new)):
            input_ids[i, :n] = torch.tensor(row.token_ids[p:], dtype=torch.long)
            attention_mask[i, P - p:P + n] = 1
            position_ids[i] = torch.arange(p, p + N)
        cache = DynamicCache()
        if P:
            L, _, H, _, D = kv.shape
            padded = kv.new_zeros(L, 2, B, H, P, D)
            for i, (p, s) in enumerate(zip(past, plan.starts)):
                padded[:, :, i, :, P - p:] = kv[:, :, :, s:s + p]
            cache = DynamicCache(list(zip(padded[:, 0].unbind(0), padded[:, 1].unbind(0))))
        out = self.model(input_ids=input_ids.to(self.device),
                         attention_mask=attention_mask.to(self.device),
                         position_ids=position_ids.to(self.device), cache=cache, use_cache=True)
        keys = torch.stack([layer.keys for layer in cache.layers])  # [L, B, H, P+N, D]
        values = torch.stack([layer.values for layer in cache.layers])
        for i, (p, n, s) in enumerate(zip(past, new, plan.starts)):
            if plan.writes[i]:
                kv[:, 0, :, s + p:s + p + n] = keys[:, i, :, P:P + n]
                kv[:, 1, :, s + p:s + p + n] = values[:, i, :, P:P + n]
        logits = out.logits.float()  # [B, N, V]
        return [logits[i, n - r.num_queries:n] for i, (r, n) in enumerate(zip(rows, new))]
