"""Row-invariant operators: a row's result depends on that row alone, not on how many rows
share the call (docs/design.md, Invariant numerics).

A library matmul picks its kernel, its blocking and its split of the reduction over threads
from the shape of the call. On this repository's CPUs a bf16 row multiplied alone, among 8
rows or among 40 comes out with different low bits (docs/benchmarks.md, *Invariant
numerics*), and so does float32. The fix here is the simplest that holds on every library:
call the matmul on one shape only. `tiled_linear` cuts the rows into blocks of exactly
`ROW_TILE` rows, zero-padding the last, so every row of every forward goes through the same
kernel with the same reduction order; within a block the row's place does not matter
(measured, and checked by the runner's start-up probe). The price is that a forward of more
than ROW_TILE rows reads the weights once per block.

Everything here is plain tensor code over fixed shapes, so a compiled path can trace it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows per matmul call. Decode and a batch-1 verify (k <= 15) fit one block; 16 rows cost
# about what one row does on the CPUs measured (docs/benchmarks.md, Invariant numerics).
ROW_TILE = 16


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tile: int = ROW_TILE) -> torch.Tensor:
    """x [..., K] -> [..., N] = x @ weight.T + bias, the matmul always on `tile` rows."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    M = rows.shape[0]
    full, rest = divmod(M, tile)
    blocks = [F.linear(rows[i * tile:(i + 1) * tile], weight, bias) for i in range(full)]
    if rest or not M:  # the last block, zero-padded to `tile` rows
        padded = F.pad(rows[full * tile:], (0, 0, 0, tile - rest))  # [tile, K]
        blocks.append(F.linear(padded, weight, bias)[:rest])
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)  # [M, N]
    return out.view(*x.shape[:-1], out.shape[-1])


class RowTiledLinear(nn.Linear):
    """An nn.Linear whose forward is tiled_linear (same parameters, same state dict)."""

    tile = ROW_TILE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_linear(x, self.weight, self.bias, self.tile)


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
