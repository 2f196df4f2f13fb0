"""Attention over the KV pool at fixed shapes, from PyTorch's own kernels: what a compiled
forward (`specdecode/executor/compiled_forward.py`) traces, on every device (docs/design.md,
Executor).

A static batch is uniform: B rows, each feeding exactly q new tokens (the packed batch is
[B * q] tokens, row b owning b*q:(b+1)*q) whose keys/values were just written at the end of
the row's pool extent. Everything a layer needs about the batch is a tensor (`StaticRows`),
so one compiled graph serves every batch of that (B, q), whatever the rows' lengths.

Which key a query sees is one function, `visible`, evaluated by both backends: key position p
of row b is seen by query i when it is cached (p < past[b]) or when it is a new token j =
p - past[b] that `new_mask[b, i, j]` allows (lower-triangular: causal; a tree of drafts gives
another mask of the same shape).

- `FlexBackend`: `torch.nn.attention.flex_attention` over the whole pool layer with a
  BlockMask built from the rows' extents (each row's kv blocks are its extent's blocks), so
  shapes never depend on the rows' lengths. Fast only compiled (eager, it is the reference).
- `PaddedSdpaBackend`: each row's keys gathered into a [B, kv_heads, W, D] window (W = the
  batch's longest row) and one scaled_dot_product_attention with a mask; W is the one dynamic
  dimension of the compiled graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

FLEX_BLOCK = 128  # keys per flex block (and the whole query length, q <= 128, is one block)


@dataclass
class StaticRows:
    """The tensors a static batch's attention reads (shapes fixed by B and q)."""

    starts: torch.Tensor  # [B] long: first pool slot of each row's extent
    past: torch.Tensor  # [B] long: cached keys before the row's q new tokens
    new_mask: torch.Tensor  # [B, q, q] bool: query i sees new token j
    slots: torch.Tensor  # [B * q] long: pool slots receiving the new keys/values
    window: torch.Tensor  # [W] long, arange: key positions a padded row spans (W >= its keys)
    block_mask: BlockMask | None = None  # flex: built once per forward by `prepare`


def causal_new_mask(B: int, q: int, device) -> torch.Tensor:
    """[B, q, q] bool, lower triangular: each new token sees itself and those before it."""
    return torch.ones(q, q, dtype=torch.bool, device=device).tril().expand(B, q, q)


def visible(rows: StaticRows, b, i, p):
    """Whether query i of row b sees the key at row position p (tensors that broadcast)."""
    j = p - rows.past[b]  # index among the new tokens (negative: cached)
    q = rows.new_mask.shape[-1]
    new = (j >= 0) & (j < q) & rows.new_mask[b, i, j.clamp(0, q - 1)]
    return (j < 0) & (p >= 0) | new


class StaticBackend:
    """Writes the new keys/values of a static batch and attends over the pool.

    The pool layout is the eager backend's ([layers, 2, kv_heads, tokens, D] for SDPA,
    token_dim 3; flash-attn's [layers, 2, tokens, kv_heads, D], token_dim 2), so a service
    keeps one pool for its eager and compiled forwards."""

    name = "abstract"
    window = False  # whether attend reads rows.window (then its length is a dynamic dim)

    def __init__(self, token_dim: int = 3):
        self.token_dim = token_dim

    def _keys_values(self, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, tokens, D] views of one layer's keys and values."""
        if self.token_dim == 3:
            return kv_layer[0], kv_layer[1]
        return kv_layer[0].transpose(0, 1), kv_layer[1].transpose(0, 1)

    def prepare(self, rows: StaticRows, pool_tokens: int) -> StaticRows:
        """Per-forward set-up shared by all layers."""
        return rows

    def write(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rows: StaticRows) -> None:
        """k, v [B*q, kv_heads, D] -> the rows' slots, in place (an opaque mutating op: a
        compiled graph writes the pool where it lies instead of copying it)."""
        write_kv(kv_layer, k, v, rows.slots, self.token_dim)


@torch.library.custom_op("specdecode::write_kv", mutates_args=("kv_layer",))
def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             token_dim: int) -> None:
    """kv_layer [2, kv_heads, T, D] (token_dim 3) or [2, T, kv_heads, D] (token_dim 2);
    k, v [N, kv_heads, D]; slots [N]."""
    if token_dim == 3:
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    kv_layer[0].index_copy_(token_dim - 2, slots, k)
    kv_layer[1].index_copy_(token_dim - 2, slots, v)


@write_kv.register_fake
def _(kv_layer, k, v, slots, token_dim) -> None:
    return None

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, rows: StaticRows,
               scale: float) -> torch.Tensor:
        """q [B*q, heads, D] -> [B*q, heads * D]."""
        raise NotImplementedError


class FlexBackend(StaticBackend):
    name = "flex"

    def prepare(self, rows, pool_tokens):
        rows.block_mask = self.block_mask(rows, pool_tokens)
        return rows

    def block_mask(self, rows: StaticRows, pool_tokens: int) -> BlockMask:
        """Row b's kv blocks (FLEX_BLOCK keys each) over its extent: *full* ones hold cached
        keys only (every query sees them: no mask evaluated), *partial* ones the extent's
        unaligned first block and the blocks from the new tokens' on (mask_mod decides).
        Index rows are as wide as the pool (the mask must cover every key; only a row's
        own counts are read)."""
        width = -(-pool_tokens // FLEX_BLOCK)
        F = FLEX_BLOCK
        first = rows.starts // F  # [B] first block of the row's keys
        last = (rows.starts + rows.past + rows.new_mask.shape[-1] - 1) // F  # [B] its last
        f0, f1 = -(-rows.starts // F), (rows.starts + rows.past) // F  # full: [f0, f1)
        full_n = (f1 - f0).clamp(min=0)
        lead = (full_n > 0) & (first < f0)  # an unaligned first block before the full ones
        tail = torch.where(full_n > 0, f1, first)  # first partial block after them
        j = torch.arange(width, device=first.device)  # [width]
        partial = torch.where(j < lead[:, None].long(), first[:, None],
                              tail[:, None] + j - lead[:, None].long())  # [B, width]
        full = f0[:, None] + j  # [B, width]
        as_mask = lambda t: t.clamp(max=width - 1).to(torch.int32)[:, None, None, :]  # noqa: E731
        count = lambda t: t.to(torch.int32)[:, None, None]  # noqa: E731
        starts = rows.starts

        def mask_mod(b, h, qi, kv):
            return visible(rows, b, qi, kv - starts[b])

        return BlockMask.from_kv_blocks(
            count(lead.long() + last + 1 - tail), as_mask(partial),  # [B, 1, 1], [B, 1, 1, W]
            count(full_n), as_mask(full), BLOCK_SIZE=(F, F), mask_mod=mask_mod,
            seq_lengths=(rows.new_mask.shape[-1], pool_tokens), compute_q_blocks=False)

    def attend(self, q, kv_layer, rows, scale):
        B, n = rows.new_mask.shape[:2]
        N, H, D = q.shape
        keys, values = self._keys_values(kv_layer)  # [kv_heads, T, D]
        block_mask = rows.block_mask
        if block_mask is None:
            block_mask = self.block_mask(rows, keys.shape[1])
        # A buffer of its own: inductor's CPU template reads the query's layout as 4-d.
        query = q.new_empty(B, H, n, D).copy_(q.view(B, n, H, D).transpose(1, 2))
        o = flex_attention(query, keys[None], values[None], block_mask=block_mask, scale=scale,
                           enable_gqa=H != keys.shape[0])  # [B, H, n, D]
        return o.transpose(1, 2).reshape(N, H * D)


class PaddedSdpaBackend(StaticBackend):
    name = "sdpa-padded"
    window = True

    def attend(self, q, kv_layer, rows, scale):
        B, n = rows.new_mask.shape[:2]
        N, H, D = q.shape
        keys, values = self._keys_values(kv_layer)  # [kv_heads, T, D]
        Hkv = keys.shape[0]
        p = rows.window  # [W]
        idx = (rows.starts[:, None] + p).clamp(max=keys.shape[1] - 1)  # [B, W]
        k = keys[:, idx].transpose(0, 1)  # [B, kv_heads, W, D], a gather
        v = values[:, idx].transpose(0, 1)
        b = torch.arange(B, device=q.device)
        mask = visible(rows, b[:, None, None], torch.arange(n, device=q.device)[None, :, None],
                       p[None, None, :])  # [B, n, W]
        g = H // Hkv  # query heads per key head, folded into the query length
        qg = q.view(B, n, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * n, D)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(1, g, 1)[:, None],
                                           scale=scale)  # [B, kv_heads, g*n, D]
        return o.view(B, Hkv, g, n, D).permute(0, 3, 1, 2, 4).reshape(N, H * D)


STATIC_BACKENDS = {"flex": FlexBackend, "sdpa-padded": PaddedSdpaBackend}
