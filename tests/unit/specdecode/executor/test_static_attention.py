"""Every attention backend over the KV pool gives per-row SDPA's result (float32, tight): the
static ones (flex, padded SDPA) eager and compiled with fullgraph=True, on ragged rows whose
extents start off flex's block grid and span several of its blocks; the optional ones
(flash-attn, torch_npu) where their device is present."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from specdecode.executor.attention import AttnBatch, FlashAttnBackend, NpuBackend, SdpaBackend
from specdecode.executor.static_attention import (FlexBackend, PaddedSdpaBackend, StaticRows,
                                                  causal_new_mask)
from tests.support.paths import ROOT

H, HKV, D, POOL = 4, 2, 16, 1024
STARTS, CACHED = [16, 400, 640], [300, 0, 7]  # unaligned to 128; a row with nothing cached


def case(q: int, token_dim: int = 3, seed: int = 0, starts: tuple[int, ...] = tuple(STARTS)):
    """(query [B*q, H, D], pool layer in the backend's layout, ragged batch, static rows)."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, HKV, POOL, D, generator=gen)  # [2, Hkv, T, D]
    query = torch.randn(len(starts) * q, H, D, generator=gen)
    lens = [c + q for c in CACHED]
    slots = torch.tensor([s + c + j for s, c in zip(starts, CACHED) for j in range(q)])
    batch = AttnBatch([b * q for b in range(len(starts) + 1)], list(starts), lens, slots, None)
    rows = StaticRows(torch.tensor(starts), torch.tensor(CACHED),
                      causal_new_mask(len(starts), q, "cpu"), slots, torch.arange(320))
    layer = kv if token_dim == 3 else kv.transpose(1, 2).contiguous()  # [2, T, Hkv, D]
    return query, layer, batch, rows


def per_row(query, kv, batch):
    backend = SdpaBackend()
    backend.prepare(batch, H // HKV, query.device)
    return backend.attend(query, kv, batch, D ** -0.5)


@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("backend", [FlexBackend, PaddedSdpaBackend])
def test_static_backends_equal_per_row_sdpa_eager(backend, q):
    query, kv, batch, rows = case(q)
    out = backend().attend(query, kv, rows, D ** -0.5)
    torch.testing.assert_close(out, per_row(query, kv, batch), atol=1e-5, rtol=1e-5)


def test_static_backends_read_flash_attns_pool_layout():
    query, kv, batch, rows = case(5)
    _, layer2, _, _ = case(5, token_dim=2)
    want = per_row(query, kv, batch)
    for backend in (FlexBackend(token_dim=2), PaddedSdpaBackend(token_dim=2)):
        torch.testing.assert_close(backend.attend(query, layer2, rows, D ** -0.5), want,
                                   atol=1e-5, rtol=1e-5)


def test_a_new_token_mask_other_than_causal_is_honoured():
    """The hook a tree of drafts uses: query 3 of each row does not see new token 1 (its
    sibling branch), every query still sees the cached prefix."""
    query, kv, batch, rows = case(5)
    tree = causal_new_mask(len(STARTS), 5, "cpu").clone()
    tree[:, 3, 1] = False
    rows.new_mask = tree
    want = torch.empty(len(STARTS) * 5, H, D)
    for b, (s, c) in enumerate(zip(STARTS, CACHED)):
        k = kv[0, :, s:s + c + 5].repeat_interleave(H // HKV, 0)  # [H, c+5, D]
        v = kv[1, :, s:s + c + 5].repeat_interleave(H // HKV, 0)
        mask = torch.cat([torch.ones(5, c, dtype=torch.bool), tree[b]], 1)  # [5, c+5]
        o = torch.nn.functional.scaled_dot_product_attention(
            query[b * 5:(b + 1) * 5].transpose(0, 1), k, v, attn_mask=mask)
        want[b * 5:(b + 1) * 5] = o.transpose(0, 1)
    for backend in (FlexBackend(), PaddedSdpaBackend()):
        out = backend.attend(query, kv, rows, D ** -0.5).view(-1, H, D)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out, per_row(query, kv, batch).view(-1, H, D))


@pytest.mark.parametrize("backend", [FlexBackend, PaddedSdpaBackend])
def test_static_backends_compile_without_a_graph_break_and_equal_per_row_sdpa(backend):
    query, kv, batch, rows = case(5)
    be = backend()
    torch._dynamo.reset()
    compiled = torch.compile(lambda qq, kk, rr: be.attend(qq, kk, rr, D ** -0.5),
                             fullgraph=True)
    with torch.inference_mode():
        out = compiled(query, kv, rows)
    torch.testing.assert_close(out, per_row(query, kv, batch), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flash_attn")
                    is None, reason="flash-attn runs on CUDA only (optional)")
def test_flash_attn_equals_per_row_sdpa_on_cuda():
    query, kv, batch, _ = case(5, token_dim=2, starts=(0, 512, 768))  # its 256-token blocks
    query, kv = query.cuda().half(), kv.cuda().half()
    backend = FlashAttnBackend()
    backend.prepare(batch, H // HKV, query.device)
    out = backend.attend(query, kv, batch, D ** -0.5)
    want = per_row(query, kv.transpose(1, 2), batch)
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None,
                    reason="torch_npu runs on Ascend only (optional)")
def test_npu_fused_attention_equals_per_row_sdpa():
    query, kv, batch, _ = case(5)
    query, kv = query.to("npu").half(), kv.to("npu").half()
    out = NpuBackend().attend(query, kv, batch, D ** -0.5)
    torch.testing.assert_close(out, per_row(query, kv, batch), atol=2e-3, rtol=2e-3)


def test_flash_attn_is_imported_only_by_its_optional_backend():
    hits = [str(p.relative_to(ROOT)) for d in ("specdecode", "scorer_svc", "proposer_svc",
                                               "orchestrator", "specdecode_stack", "bench")
            if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py")
            if re.search(r"^\s*(from flash_attn|import flash_attn)", p.read_text(), re.M)]
    assert hits == ["specdecode/executor/attention.py"]
