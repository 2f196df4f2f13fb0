"""Attention over a ragged batch that reads the KV pool in place, behind one small interface.

A batch packs every row's new tokens one after another ([N] tokens, row i owning
q_starts[i]:q_starts[i+1]); row i's keys are the kv_lens[i] pool slots from kv_starts[i]
(its cached prefix, then its new tokens, written first). Query j of row i sits at position
kv_lens[i] - n_i + j and sees keys 0..that position (causal, aligned bottom-right).

Backends (docs/design.md, Executor):
- `SdpaBackend`: PyTorch scaled_dot_product_attention on strided views of the pool, one call
  per row and layer. Every device; the CPU path, tested by the whole suite.
- `FlashAttnBackend`: flash-attn's varlen kernel with a block table over the pool, on CUDA
  when `flash_attn` is installed; one call per layer, shapes fixed by the batch (so it can be
  captured in a CUDA graph). NOT RUN HERE: written without a GPU.
- `NpuBackend`: torch_npu's fused inference attention per row on Ascend. NOT RUN HERE.
- `InvariantSdpaBackend`: the deterministic mode's: every query attends as a one-token decode
  would, so its result does not depend on how many queries its row has.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttnBatch:
    """What every layer's attention needs about one forward's batch (built once)."""

    q_starts: list[int]  # [B+1] offsets of each row's new tokens in the packed batch
    kv_starts: list[int]  # [B] first pool slot of each row's sequence
    kv_lens: list[int]  # [B] keys each row attends: cached + new
    write_slots: torch.Tensor  # [W] long: pool slots that receive new keys/values
    write_tokens: torch.Tensor | None  # [W] long: packed tokens written there (None = all N)
    extra: dict = field(default_factory=dict)  # per-backend tensors (masks, block tables)

    @property
    def num_rows(self) -> int:
        return len(self.kv_starts)

    def rows(self) -> list[tuple[int, int, int, int]]:
        """Per row: (its first packed query, the end of its queries, its first pool slot,
        its keys)."""
        return list(zip(self.q_starts, self.q_starts[1:], self.kv_starts, self.kv_lens))


class AttentionBackend:
    """Owns the pool's layout: allocates it, writes new keys/values, attends over it."""

    name = "abstract"
    token_dim = 3  # the token-slot dimension of the pool tensor
    block_size = 16

    def allocate(self, layers: int, kv_heads: int, tokens: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The pool: [layers, 2 (keys, values), kv_heads, tokens, head_dim]. torch.empty, so
        untouched pages cost no host memory."""
        return torch.empty(layers, 2, kv_heads, tokens, head_dim, dtype=dtype, device=device)

    def prepare(self, batch: AttnBatch, num_groups: int, device: torch.device) -> None:
        """Per-forward set-up shared by all layers (masks, index tensors)."""

    def write(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              batch: AttnBatch) -> None:
        """k, v [N, kv_heads, D] of the packed new tokens -> their pool slots, in place."""
        if batch.write_tokens is not None:
            k, v = k[batch.write_tokens], v[batch.write_tokens]
        kv_layer[0].index_copy_(1, batch.write_slots, k.transpose(0, 1))
        kv_layer[1].index_copy_(1, batch.write_slots, v.transpose(0, 1))

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, batch: AttnBatch,
               scale: float) -> torch.Tensor:
        """q [N, heads, D] -> [N, heads * D]."""
        raise NotImplementedError


def causal_mask(n: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Bool [n, kv_len]: query j (at position kv_len - n + j) sees keys 0..its position."""
    positions = torch.arange(kv_len - n, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] <= positions[:, None]


class SdpaBackend(AttentionBackend):
    """One scaled_dot_product_attention per row on views of the pool (no copy of the keys).

    Grouped-query attention without repeating keys: the g query heads that share a key head
    are folded into the query length ([1, kv_heads, g * n, D]), so the call sees as many
    heads as the pool holds; a row's whole-prompt prefill uses is_causal instead.
    """

    name = "sdpa"

    def prepare(self, batch: AttnBatch, num_groups: int, device: torch.device) -> None:
        masks = []
        for i in range(batch.num_rows):
            n, kv_len = batch.q_starts[i + 1] - batch.q_starts[i], batch.kv_lens[i]
            if n == 1 or n == kv_len:
                masks.append(None)  # one query sees every key; a full prompt is plain causal
            else:
                masks.append(causal_mask(n, kv_len, device).repeat(num_groups, 1))  # [g*n, kv]
        batch.extra["masks"] = masks

    def attend(self, q, kv_layer, batch, scale):
        N, H, D = q.shape
        kv_heads = kv_layer.shape[1]
        g = H // kv_heads
        out = torch.empty(N, H, D, dtype=q.dtype, device=q.device)
        for i, (a, b, s, kv_len) in enumerate(batch.rows()):
            n = b - a
            k = kv_layer[0, :, s:s + kv_len][None]  # [1, kv_heads, kv_len, D], a view
            v = kv_layer[1, :, s:s + kv_len][None]
            if n == kv_len and n > 1:  # prefill from scratch
                o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k, v,
                                                   is_causal=True, scale=scale,
                                                   enable_gqa=g > 1)  # [1, H, n, D]
                out[a:b] = o[0].transpose(0, 1)
            else:
                qg = q[a:b].view(n, kv_heads, g, D).permute(1, 2, 0, 3).reshape(1, kv_heads,
                                                                                 g * n, D)
                o = F.scaled_dot_product_attention(qg, k, v, attn_mask=batch.extra["masks"][i],
                                                   scale=scale)  # [1, kv_heads, g*n, D]
                out[a:b] = o.view(kv_heads, g, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
        return out.view(N, H * D)


class InvariantSdpaBackend(SdpaBackend):
    """Decode-equivalent attention (docs/design.md, Invariant numerics): every query is one
    scaled_dot_product_attention call over exactly the keys it sees, shaped as a one-token
    decode ([1, kv_heads, g, D] over [1, kv_heads, position + 1, D]). A query of a verify or
    of a prefill chunk therefore takes the very call a decode at its position takes: the same
    kernel, the same key blocks, the same reduction order, whatever the number of queries."""

    name = "sdpa-invariant"

    def prepare(self, batch, num_groups, device):
        pass  # no masks: each query reads a prefix of its row's keys

    def attend(self, q, kv_layer, batch, scale):
        N, H, D = q.shape
        kv_heads = kv_layer.shape[1]
        out = torch.empty(N, H, D, dtype=q.dtype, device=q.device)
        for a, b, s, kv_len in batch.rows():
            first = kv_len - (b - a) + 1  # the keys query a sees
            for j in range(b - a):
                k = kv_layer[0, :, s:s + first + j][None]  # [1, kv_heads, position + 1, D]
                v = kv_layer[1, :, s:s + first + j][None]
                qg = q[a + j].view(1, kv_heads, H // kv_heads, D)  # [1, kv_heads, g, D]
                out[a + j] = F.scaled_dot_product_attention(qg, k, v, scale=scale).view(H, D)
        return out.view(N, H * D)


class FlashAttnBackend(AttentionBackend):
    """flash-attn varlen attention with a paged block table (CUDA). NOT RUN HERE.

    Pool layout [layers, 2, tokens, kv_heads, D], i.e. per layer [blocks, 256, kv_heads, D],
    as flash-attn's paged KV wants (block size a multiple of 256). A row's extent is a run of
    consecutive blocks, so its block-table row is first_block + arange.
    """

    name = "flash-attn"
    token_dim = 2
    block_size = 256

    def __init__(self):
        from flash_attn import flash_attn_varlen_func  # noqa: PLC0415 (optional, CUDA only)
        self._varlen = flash_attn_varlen_func

    def allocate(self, layers, kv_heads, tokens, head_dim, dtype, device):
        return torch.empty(layers, 2, tokens, kv_heads, head_dim, dtype=dtype, device=device)

    def prepare(self, batch, num_groups, device):
        n = [b - a for a, b in zip(batch.q_starts, batch.q_starts[1:])]
        width = max(-(-L // self.block_size) for L in batch.kv_lens)
        first = torch.tensor([s // self.block_size for s in batch.kv_starts])
        batch.extra.update(
            cu_q=torch.tensor(batch.q_starts, dtype=torch.int32, device=device),
            cu_k=torch.tensor([0] + batch.kv_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            .to(device),
            max_q=max(n), max_k=max(batch.kv_lens),
            block_table=(first[:, None] + torch.arange(width)[None]).to(torch.int32).to(device))

    def write(self, kv_layer, k, v, batch):
        if batch.write_tokens is not None:
            k, v = k[batch.write_tokens], v[batch.write_tokens]
        kv_layer[0].index_copy_(0, batch.write_slots, k)
        kv_layer[1].index_copy_(0, batch.write_slots, v)

    def attend(self, q, kv_layer, batch, scale):
        N, H, D = q.shape
        paged = lambda t: t.view(-1, self.block_size, *t.shape[1:])  # noqa: E731
        e = batch.extra
        out = self._varlen(q, paged(kv_layer[0]), paged(kv_layer[1]), e["cu_q"], e["cu_k"],
                           e["max_q"], e["max_k"], softmax_scale=scale, causal=True,
                           block_table=e["block_table"])
        return out.reshape(N, H * D)


class NpuBackend(SdpaBackend):
    """torch_npu fused inference attention, one call per row on views of the pool (Ascend).
    NOT RUN HERE: no NPU was available; the call follows torch_npu's documented BNSD form."""

    name = "npu-fused"

    def attend(self, q, kv_layer, batch, scale):
        import torch_npu  # noqa: PLC0415 (Ascend only)

        N, H, D = q.shape
        kv_heads = kv_layer.shape[1]
        out = torch.empty(N, H, D, dtype=q.dtype, device=q.device)
        for a, b, s, kv_len in batch.rows():
            mask = None if b - a == 1 else ~causal_mask(b - a, kv_len, q.device)  # True = masked
            o, _ = torch_npu.npu_fused_infer_attention_score(
                q[a:b].transpose(0, 1)[None], kv_layer[0, :, s:s + kv_len][None],
                kv_layer[1, :, s:s + kv_len][None], atten_mask=mask, num_heads=H,
                num_key_value_heads=kv_heads, scale=scale, input_layout="BNSD")
            out[a:b] = o[0].transpose(0, 1)
        return out.view(N, H * D)


def select_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The fastest backend installed for `device` (SDPA when nothing better is present;
    flash-attn computes in float16/bfloat16 only)."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and \
            importlib.util.find_spec("flash_attn") is not None:
        return FlashAttnBackend()
    if device.type == "npu":
        return NpuBackend()
    return SdpaBackend()
