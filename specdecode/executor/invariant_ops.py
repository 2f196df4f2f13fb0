"""Row-invariant operators: a row's result depends on that row alone, not on how many rows
share the call (docs/design.md, Invariant numerics).

A library matmul picks its kernel, its blocking and its split of the reduction over threads
from the shape of the call. On this repository's CPUs a bf16 row multiplied alone, among 8
rows or among 40 comes out with different low bits (docs/benchmarks.md, *Invariant
numerics*), and so does float32. The fix here is the simplest that holds on every library:
call the matmul on one shape only. `tiled_linear` cuts the rows into blocks of exactly
`ROW_TILE` rows, zero-padding the last, so every row of every forward goes through the same
kernel with the same reduction order; within a block the row's place does not matter
(measured). The price is that a forward of more than ROW_TILE rows reads the weights once
per block.

On a CPU with bf16 (or fp16) units, `RowTiledLinear` also packs its weight once into
oneDNN's blocked layout for that one shape: the kernel and the result are those of
F.linear on ROW_TILE rows (measured bit for bit), without the copy of the weight into that
layout which F.linear makes on every call. Everything here is plain tensor code over fixed
shapes, so a compiled path can trace it (PyTorch's own CPU compiler packs linears the same
way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Rows per matmul call. Decode and a batch-1 verify (k <= 15) fit one block; 16 rows cost
# about what one row does on the CPUs measured (docs/benchmarks.md, Invariant numerics).
ROW_TILE = 16

Matmul = Callable[[torch.Tensor], torch.Tensor]  # [tile, K] -> [tile, N]


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tile: int = ROW_TILE, matmul: Matmul | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] = x @ weight.T + bias, the matmul always on `tile` rows
    (`matmul`: one block's product, F.linear by default)."""
    matmul = matmul or (lambda block: F.linear(block, weight, bias))
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    M = rows.shape[0]
    full, rest = divmod(M, tile)
    blocks = [matmul(rows[i * tile:(i + 1) * tile]) for i in range(full)]
    if rest or not M:  # the last block, zero-padded to `tile` rows
        blocks.append(matmul(F.pad(rows[full * tile:], (0, 0, 0, tile - rest)))[:rest])
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)  # [M, N]
    return out.view(*x.shape[:-1], out.shape[-1])


def packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN can hold `weight` packed for one shape: a CPU tensor in bf16 or fp16
    on a CPU with units for it (an AVX2-only host has none: F.linear on tiles there)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()


class RowTiledLinear(nn.Linear):
    """An nn.Linear whose forward is tiled_linear (same parameters, same state dict), on a
    weight packed for the tile where the CPU allows (repacked if the weight is replaced)."""

    tile = ROW_TILE
    _packed: tuple[tuple, torch.Tensor] | None = None  # (what it was packed from, packed)

    def _matmul(self) -> Matmul | None:
        weight = self.weight
        if not packable(weight):
            return None
        # An inference tensor has no version counter (and cannot change in place).
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version, self.tile)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(weight, self.tile))
        packed, bias = self._packed[1], self.bias
        return lambda block: torch.ops.mkldnn._linear_pointwise(block, packed, bias, "none",
                                                                [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_linear(x, self.weight, self.bias, self.tile, self._matmul())


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
