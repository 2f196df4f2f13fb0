"""CUDA graphs of the fast forward for the hot shapes: decode (1 new token per row) and verify
(k+1 new tokens per row, multi-query scoring), at bucketed batch sizes, captured at start-up.
NOT RUN HERE: written without a GPU; `--enforce-eager` turns it off.

A captured batch is uniform: every row feeds q new tokens, wants all q logits and owns its
pool entry. A batch of B rows replays the smallest bucket >= B; the extra rows read and write
one scratch block past the pool's managed blocks. Graphs need a backend whose kernels take
all per-batch metadata as tensors (FlashAttnBackend); the LM head is the one present at
capture time (a swapped `lm_head` needs `capture()` again).
"""

from __future__ import annotations

import logging
import time

import torch

from specdecode.attention import AttnBatch

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
QUERY_LENS = (1, 5)  # decode, and verify at k = 4


class _Graph:
    def __init__(self, B: int, q: int, width: int, device):
        self.B, self.q = B, q
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(B * q, **long)
        self.positions = torch.zeros(B * q, **long)
        self.query_index = torch.arange(B * q, **long)
        self.slots = torch.zeros(B * q, **long)
        self.cu_k = torch.zeros(B + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(B, width, dtype=torch.int32, device=device)
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None


class CudaGraphs:
    def __init__(self, forward, kv: torch.Tensor, backend, scratch_block: int,
                 max_model_len: int, device: torch.device):
        self.forward, self.kv, self.backend, self.device = forward, kv, backend, device
        self.scratch = scratch_block
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // backend.block_size)
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def _batch(self, g: _Graph) -> AttnBatch:
        B, q = g.B, g.q
        return AttnBatch([i * q for i in range(B + 1)], [0] * B, [q] * B, g.slots, None, extra={
            "cu_q": torch.arange(0, B * q + 1, q, dtype=torch.int32, device=self.device),
            "cu_k": g.cu_k, "max_q": q, "max_k": self.max_model_len,
            "block_table": g.block_table})

    def capture(self) -> None:
        start, pool = time.perf_counter(), torch.cuda.graph_pool_handle()
        for q in QUERY_LENS:
            for B in reversed(BATCH_BUCKETS):  # largest first, so smaller ones reuse its memory
                g = _Graph(B, q, self.width, self.device)
                self._fill_padding(g, 0)
                batch = self._batch(g)
                run = lambda: self.forward(g.input_ids, g.positions, g.query_index,  # noqa: E731
                                           self.kv, self.backend, batch)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    run()
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(g.graph, pool=pool):
                    g.logits = run()
                self.graphs[(B, q)] = g
        log.info("captured CUDA graphs for batch sizes %s x query lengths %s in %.1f s",
                 list(BATCH_BUCKETS), list(QUERY_LENS), time.perf_counter() - start)

    def _fill_padding(self, g: _Graph, rows: int) -> None:
        bs, q = self.backend.block_size, g.q
        g.slots[rows * q:] = self.scratch * bs + torch.arange(q, device=self.device).repeat(g.B - rows)
        g.block_table[rows:] = self.scratch
        lens = torch.full((g.B - rows,), q, dtype=torch.int32, device=self.device)
        g.cu_k[rows + 1:] = g.cu_k[rows] + lens.cumsum(0, dtype=torch.int32)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            kv_starts: list[int], kv_lens: list[int], q: int) -> torch.Tensor | None:
        """Logits [B*q, V] by replaying a captured graph, or None when no graph fits."""
        B = len(kv_starts)
        bucket = next((b for b in BATCH_BUCKETS if b >= B), None)
        g = self.graphs.get((bucket, q))
        if g is None:
            return None
        bs, n = self.backend.block_size, B * q
        g.input_ids[:n].copy_(torch.tensor(input_ids), non_blocking=True)
        g.input_ids[n:] = 0
        g.positions[:n].copy_(torch.tensor(positions), non_blocking=True)
        g.positions[n:] = 0
        g.slots[:n].copy_(torch.tensor(slots), non_blocking=True)
        g.cu_k[0] = 0
        g.cu_k[1:B + 1].copy_(torch.tensor(kv_lens).cumsum(0), non_blocking=True)
        first = torch.tensor([s // bs for s in kv_starts])[:, None]
        g.block_table[:B].copy_(first + torch.arange(self.width)[None], non_blocking=True)
        self._fill_padding(g, B)
        g.graph.replay()
        return g.logits[:n]
