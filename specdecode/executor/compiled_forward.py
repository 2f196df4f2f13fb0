"""The fast forward compiled at static shapes, for the hot shapes: decode (1 new token per row)
and verify (k+1 new tokens per row, multi-query scoring) at bucketed batch sizes, compiled at
start-up (docs/design.md, Executor).

`torch.compile(fullgraph=True)` over `LlamaLikeForward` with a `StaticBackend` (attention
from PyTorch's own kernels over the pool): on CUDA with `mode="reduce-overhead"` (CUDA
graphs), on CPU inductor's C++ backend with frozen (prepacked) weights. A batch is uniform:
every row feeds q new tokens, wants all q logits and owns its pool entry; a batch of B rows
runs the graph of the smallest bucket >= B, the extra rows reading and writing one scratch
block past the pool's managed blocks. The weights are those present at compile time (a
swapped `lm_head` needs a new runner). `--compile off` keeps the eager path.

Graphs are compiled one at a time (`compile(graphs)`, in the service's background on CPU:
specdecode/executor/compile_mode.py) and a forward takes one only once it is ready, so the
rest of the runner serves eagerly meanwhile. Inductor keeps what it compiled on disk (its FX
graph cache, keyed by the graph, the weights' shapes and dtypes, its options and torch's
version: `--compile-cache`), so a restart reloads the graphs instead of compiling them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch._dynamo

from specdecode.executor.fast_forward import LlamaLikeForward
from specdecode.executor.static_attention import StaticBackend, StaticRows, causal_new_mask

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
QUERY_LENS = (1, 5)  # decode, and verify at k = 4
WINDOW_ROUND = 16  # padded attention's key window: the longest row rounded up to this


@dataclass
class CompileStats:
    """What compiling cost, for the logs and the service's metrics."""

    seconds: float = 0.0  # compiling (or reloading) the graphs made ready so far
    graphs: int = 0  # (batch bucket, query length) pairs ready to run
    cache_hits: int = 0  # of them, reloaded from inductor's on-disk cache
    recompiles: int = 0  # graphs compiled after being made ready (a guard failed: stays 0)
    runs: int = 0  # forwards that took a compiled graph


def compile_options(device: torch.device) -> dict:
    """torch.compile's backend and options for `device`: CUDA graphs on CUDA; frozen,
    prepacked weights on CPU; torch_npu's graph backend (torchair) on Ascend (NOT RUN HERE:
    written from its documentation, no NPU was available)."""
    if device.type == "cuda":
        return {"mode": "reduce-overhead"}
    if device.type == "npu":
        import torchair  # noqa: PLC0415 (Ascend only)
        return {"backend": torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())}
    return {"options": {"freezing": True}}


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _cache_hits() -> int:
    return torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]


class CompiledForwards:
    def __init__(self, forward: LlamaLikeForward, kv: torch.Tensor, backend: StaticBackend,
                 scratch_block: int, block_size: int, device: torch.device,
                 batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
                 query_lens: tuple[int, ...] = QUERY_LENS):
        self.forward, self.kv, self.backend, self.device = forward, kv, backend, device
        self.scratch, self.block_size = scratch_block * block_size, block_size
        self.batch_buckets, self.query_lens = tuple(sorted(batch_buckets)), tuple(query_lens)
        self.pool_tokens = kv.shape[backend.token_dim]
        self.stats = CompileStats()
        self.ready: set[tuple[int, int]] = set()  # (batch bucket, query length) compiled
        self.compiling = False  # another graph compiles (in another thread): not a recompile
        limit = 4 * len(self.batch_buckets) * len(self.query_lens)  # several runners share it
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        self._compiled = torch.compile(self._static_forward, fullgraph=True, dynamic=False,
                                       **compile_options(device))

    def _static_forward(self, input_ids, positions, kv, starts, past, new_mask, slots, window):
        """input_ids, positions, slots [B*q]; starts, past [B]; new_mask [B, q, q];
        window [W] -> float32 logits [B*q, V]."""
        rows = StaticRows(starts, past, new_mask, slots, window)
        rows = self.backend.prepare(rows, self.pool_tokens)
        return self.forward(input_ids, positions, None, kv, self.backend, rows)

    def graphs(self) -> list[tuple[int, int]]:
        """Every (batch bucket, query length), decode at one row first."""
        return [(B, q) for q in self.query_lens for B in self.batch_buckets]

    @torch.inference_mode()
    def compile(self, graphs: list[tuple[int, int]] | None = None) -> None:
        """Compile `graphs` (default: all) on padding rows (the scratch block), in the
        inference mode the runner's forwards run in (a guard of the graphs); each is ready
        to run once compiled."""
        self.compiling = True
        try:
            for B, q in self.graphs() if graphs is None else graphs:
                self._compile_one(B, q)
        finally:
            self.compiling = False

    def _compile_one(self, B: int, q: int) -> None:
        begin, hits = time.perf_counter(), _cache_hits()
        self._call([], [], [], [], [], B, q)
        seconds, cached = time.perf_counter() - begin, _cache_hits() > hits
        self.ready.add((B, q))
        self.stats.seconds += seconds
        self.stats.graphs, self.stats.cache_hits = len(self.ready), self.stats.cache_hits + cached
        log.info("compiled forward of %d rows x %d queries ready in %.1f s (%s; %s, %s "
                 "attention)", B, q, seconds, "reloaded from the compile cache" if cached
                 else "compiled anew", "reduce-overhead" if self.device.type == "cuda"
                 else "inductor C++", self.backend.name)

    def drop(self) -> None:
        """No graph is taken any more: the forwards run eagerly."""
        self.ready.clear()
        self.stats.graphs = 0

    def fits(self, B: int, q: int) -> bool:
        """Whether a forward of B rows x q queries has a ready graph."""
        bucket = next((b for b in self.batch_buckets if b >= B), None)
        return (bucket, q) in self.ready

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            kv_starts: list[int], kv_lens: list[int], q: int) -> torch.Tensor:
        """Logits [B*q, V] of a uniform batch (`fits`) through its bucket's compiled graph."""
        B = len(kv_starts)
        bucket = next(b for b in self.batch_buckets if b >= B)
        before = _graphs_compiled()
        logits = self._call(input_ids, positions, slots, kv_starts, kv_lens, bucket, q)
        if _graphs_compiled() > before and not self.compiling:
            self.stats.recompiles += _graphs_compiled() - before
            log.warning("compiled forward: recompiled for batch %d (bucket %d) x %d queries",
                        B, bucket, q)
        self.stats.runs += 1
        return logits[:B * q]

    def _call(self, input_ids, positions, slots, kv_starts, kv_lens, bucket, q):
        """Pads the rows to `bucket` with scratch rows and runs the compiled graph."""
        pad = bucket - len(kv_starts)
        scratch = range(self.scratch, self.scratch + q)
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        lens = list(kv_lens) + [q] * pad
        width = -(-max(lens) // WINDOW_ROUND) * WINDOW_ROUND if self.backend.window else 1
        window = torch.arange(width, device=self.device)
        if self.backend.window:
            torch._dynamo.mark_dynamic(window, 0, min=2, max=self.pool_tokens + WINDOW_ROUND)
        logits = self._compiled(
            as_long(list(input_ids) + [0] * (pad * q)),
            as_long(list(positions) + list(range(q)) * pad), self.kv,
            as_long(list(kv_starts) + [self.scratch] * pad),
            as_long([n - q for n in lens]), causal_new_mask(bucket, q, self.device),
            as_long(list(slots) + list(scratch) * pad), window)
        return logits.clone() if self.device.type == "cuda" else logits  # graphs reuse output

