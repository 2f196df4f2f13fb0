"""Row-invariant operators: a row's result depends on that row alone, not on how many rows
share the call (docs/design.md, Invariant numerics).

A library matmul picks its kernel, its blocking and its split of the reduction over threads
from the shape of the call. On this repository's CPUs a bf16 row multiplied alone, among 8
rows or among 40 comes out with different low bits (docs/benchmarks.md, *Invariant
numerics*), and so does float32. The fix here is the simplest that holds on every library:
call the matmul on a few shapes only, each giving the bits of the one shape of `ROW_TILE`
rows. `tiled_linear` cuts the rows into blocks of ROW_TILE rows and puts the rest (or a
forward of fewer rows) in the smallest allowed block that holds it, zero-padded; within a
block the row's place does not matter (measured). Which smaller blocks are allowed is
measured, not assumed: `equal_tiles` keeps each of `SMALL_TILES` whose rows come out bit for
bit as in ROW_TILE-row blocks, per weight shape, dtype, kernel and thread count (on an
AVX512-BF16 CPU every size from 2 to 16 in bf16 does on a weight packed once; one row, a
matrix-vector kernel, does not). A decode then multiplies 4 rows, not 16, and a verify of
k + 1 rows k + 1. A forward of at least WIDE_MIN rows (a prompt) is cut into chunks of at
most MAX_TILE rows, each multiplied as one block of the smallest of `WIDE_TILES` that holds it,
once that size gave ROW_TILE's bits on that weight (checked when a forward first needs it: on
the EPYC every size to 512 does); a chunk below WIDE_MIN, or a size not allowed, goes in
ROW_TILE blocks as before. Below WIDE_MIN rows (a batch's verify) a wide block measured no
cheaper than 16-row blocks, and for the draft's shapes dearer.

On a CPU with bf16 (or fp16) units, `RowTiledLinear` also packs its weight once into
oneDNN's blocked layout (one layout serves every block size): the kernel and the result are
those of F.linear on the same rows (measured bit for bit), without the copy of the weight
into that layout which F.linear makes on every call. Everything here is plain tensor code
over fixed shapes, so a compiled path can trace it (PyTorch's own CPU compiler packs linears
the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# Rows per matmul call at most, and the block whose bits every other block size must give.
# A batch-1 verify (k <= 15) fits one block.
ROW_TILE = 16
# Smaller blocks a forward of few rows may use where they give ROW_TILE's bits (`equal_tiles`).
# On the AVX512-BF16 EPYC every size from 2 to 16 does on a weight packed once, and a block of
# 4-6 rows is the cheapest (Qwen 1.5B's gate_proj, every layer's in turn, 2 threads: 1.33 ms
# for 1 row, 1.10 for 2, 0.97-1.00 for 4-6, 1.16 for 8, 1.67 for 16; docs/benchmarks.md):
# a forward of M rows uses a block of max(M, 4) rows.
SMALL_TILES = tuple(range(4, ROW_TILE))
# Wide blocks for forwards of many rows, each allowed where it gives ROW_TILE's bits
# (`wide_tile_allowed`). EPYC, bf16, 2 threads, one block against 16-row blocks: Qwen 1.5B's
# gate_proj over 512 rows 33 against 53 ms, over 70 rows 5.6 against 6.0; but over 20-36 rows
# a wide block cost up to 1.4x more (the 0.5B draft's down_proj: 0.67 against 0.46 ms at 20),
# so only forwards of WIDE_MIN rows or more take them.
MAX_TILE = 512
WIDE_MIN = 128
WIDE_TILES = tuple(range(WIDE_MIN, MAX_TILE + 1, ROW_TILE))

Matmul = Callable[[torch.Tensor], torch.Tensor]  # [tile, K] -> [tile, N]


def block_sizes(M: int, tiles: Sequence[int]) -> list[int]:
    """How M rows are cut: blocks of the largest tile, then the rest (or M < that tile, or
    M = 0) in the smallest tile that holds it."""
    tile = max(tiles)
    full, rest = divmod(M, tile)
    return [tile] * full + ([min(t for t in tiles if t >= rest)] if rest or not M else [])


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tiles: Sequence[int] = (ROW_TILE,), matmul: Matmul | None = None
                 ) -> torch.Tensor:
    """x [..., K] -> [..., N] = x @ weight.T + bias, the matmul only ever on a number of rows
    in `tiles` (`block_sizes`; `matmul`: one block's product, F.linear by default)."""
    matmul = matmul or (lambda block: F.linear(block, weight, bias))
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    blocks, start = [], 0
    for size in block_sizes(rows.shape[0], tiles):
        block = rows[start:start + size]  # [<= size, K], zero-padded to [size, K]
        n = block.shape[0]
        blocks.append(matmul(F.pad(block, (0, 0, 0, size - n)) if n < size else block)[:n])
        start += size
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)  # [M, N]
    return out.view(*x.shape[:-1], out.shape[-1])


# (weight shape, dtype, kernel, tile, candidates, threads) -> the tiles giving the tile's bits
_EQUAL: dict[tuple, tuple[int, ...]] = {}


def equal_tiles(matmul: Matmul, weight: torch.Tensor, kernel: str, tile: int = ROW_TILE,
                candidates: Sequence[int] = SMALL_TILES) -> tuple[int, ...]:
    """`tile` and those of `candidates` whose blocks give each row the bits that blocks of
    `tile` rows give it (random rows against `weight`: the kernel, its blocking and its order
    of reduction follow from the call's shape, never from the values; a different order
    rounds some of tile x N outputs differently). Measured once per shape, dtype, kernel and
    thread count in a process."""
    key = (tuple(weight.shape), weight.dtype, kernel, tile, tuple(candidates),
           torch.get_num_threads())
    if key not in _EQUAL:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tile, weight.shape[1], generator=gen).to(weight.dtype)  # [tile, K]
        with torch.inference_mode():
            ref = matmul(x)  # [tile, N]
            _EQUAL[key] = tuple(sorted({tile, *(
                t for t in candidates if t < tile and torch.equal(  # the first tile // t blocks
                    torch.cat([matmul(x[i:i + t]) for i in range(0, tile - t + 1, t)]),
                    ref[:tile // t * t]))}))
    return _EQUAL[key]


# (weight shape, dtype, kernel, tile, wide tile, threads) -> whether it gives the tile's bits
_WIDE: dict[tuple, bool] = {}


def wide_tile_allowed(matmul: Matmul, weight: torch.Tensor, kernel: str, wide: int,
                      tile: int = ROW_TILE) -> bool:
    """Whether one block of `wide` rows (a multiple of `tile`) gives each row the bits that
    blocks of `tile` rows give it (random rows against `weight`, as equal_tiles); measured
    once per shape, dtype, kernel and thread count in a process."""
    key = (tuple(weight.shape), weight.dtype, kernel, tile, wide, torch.get_num_threads())
    if key not in _WIDE:
        gen = torch.Generator().manual_seed(wide)
        x = torch.randn(wide, weight.shape[1], generator=gen).to(weight.dtype)  # [wide, K]
        with torch.inference_mode():
            ref = torch.cat([matmul(x[i:i + tile]) for i in range(0, wide, tile)])
            _WIDE[key] = torch.equal(matmul(x), ref)
    return _WIDE[key]


def wide_tile_for(rows: int) -> int | None:
    """The wide block a chunk of `rows` rows (at most MAX_TILE) would take: the smallest of
    WIDE_TILES holding it, None below WIDE_MIN."""
    return next((t for t in WIDE_TILES if t >= rows), None) if rows >= WIDE_MIN else None


def packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN can hold `weight` packed for one shape: a CPU tensor in bf16 or fp16
    on a CPU with units for it (an AVX2-only host has none: F.linear on tiles there)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()


class RowTiledLinear(nn.Linear):
    """An nn.Linear whose forward is tiled_linear (same parameters, same state dict) on the
    blocks `equal_tiles` and `wide_tile_allowed` allow, on a weight packed once where the CPU
    allows (repacked, and the blocks checked again, if the weight or the thread count
    changes)."""

    tile = ROW_TILE
    candidates: tuple[int, ...] = SMALL_TILES  # () pins every call to `tile` rows
    # (made from, matmul, tiles, kernel)
    _plan: tuple[tuple, Matmul, tuple[int, ...], str] | None = None

    def _prepare(self) -> tuple[Matmul, tuple[int, ...]]:
        weight = self.weight
        # An inference tensor has no version counter (and cannot change in place).
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version, self.tile,
               self.candidates, torch.get_num_threads())
        if self._plan is None or self._plan[0] != key:
            if packable(weight):
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.tile)
                matmul, kernel = (lambda block: torch.ops.mkldnn._linear_pointwise(
                    block, packed, self.bias, "none", [], "")), "onednn-packed"
            else:
                matmul, kernel = (lambda block: F.linear(block, self.weight, self.bias)), "linear"
            kernel += "+bias" if self.bias is not None else ""  # a fused post-op
            self._plan = (key, matmul, equal_tiles(matmul, weight, kernel, self.tile,
                                                   self.candidates), kernel)
        return self._plan[1], self._plan[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul, tiles = self._prepare()
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        if rows.shape[0] < WIDE_MIN or not self.candidates:
            return tiled_linear(x, self.weight, self.bias, tiles, matmul)
        out = torch.cat([self._chunk(rows[i:i + MAX_TILE], matmul, tiles)
                         for i in range(0, rows.shape[0], MAX_TILE)])  # [M, N]
        return out.view(*x.shape[:-1], out.shape[-1])

    def _chunk(self, rows: torch.Tensor, matmul: Matmul, tiles: tuple[int, ...]) -> torch.Tensor:
        """rows [<= MAX_TILE, K] -> [.., N]: one wide block where allowed, else `tiles`."""
        wide = wide_tile_for(rows.shape[0])
        if wide and wide_tile_allowed(matmul, self.weight, self._plan[3], wide, self.tile):
            tiles = (wide,)
        return tiled_linear(rows, self.weight, self.bias, tiles, matmul)


def make_row_invariant(module: nn.Module) -> int:
    """Turn every nn.Linear inside `module` (itself included) into a RowTiledLinear, in
    place (the parameters are kept); returns how many were converted."""
    converted = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = RowTiledLinear
            converted += 1
    return converted


def is_row_invariant(module: nn.Module) -> bool:
    return isinstance(module, RowTiledLinear)
