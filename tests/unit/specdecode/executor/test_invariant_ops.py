"""Row-invariant operators (specdecode.executor.invariant_ops, InvariantSdpaBackend): a row's
bits do not depend on the rows or queries that share its call. Random data at real models' shapes
(SmolLM2's and Qwen2.5-1.5B's attention and MLP widths), bf16 and float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from proposer_svc.pruned_head import PrunedLMHead, prune_lm_head
from specdecode.executor import invariant_ops
from specdecode.executor.attention import AttnBatch, InvariantSdpaBackend
from specdecode.executor.invariant_ops import (MAX_TILE, ROW_TILE, SMALL_TILES, WIDE_MIN,
                                               RowTiledLinear, block_sizes, equal_tiles,
                                               is_row_invariant, make_row_invariant,
                                               tiled_linear, wide_tile_allowed, wide_tile_for)
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model

CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float32]
SHAPES = [(576, 1536), (1536, 576), (1536, 8960), (8960, 1536)]  # (in, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_tiled_row_is_the_same_bits_alone_and_among_any_number_of_rows(dtype, shape):
    """Every M from 1 to 3 tiles and past: each row equals that row computed alone. The
    plain matmul on this CPU changes kernels with M (docs/benchmarks.md, Invariant
    numerics); the tiled one always runs ROW_TILE rows."""
    K, N = shape
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    x = torch.randn(3 * ROW_TILE + 5, K, generator=gen).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([tiled_linear(x[i:i + 1], weight, bias) for i in range(len(x))])
        for M in (2, 5, ROW_TILE, ROW_TILE + 1, 2 * ROW_TILE + 3, len(x)):
            assert torch.equal(tiled_linear(x[:M], weight, bias), alone[:M]), M
        # A row's place inside its tile does not matter either (the batch puts it anywhere).
        assert torch.equal(tiled_linear(x[7:7 + ROW_TILE + 2], weight, bias), alone[7:ROW_TILE + 9])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_a_row_tiled_linear_is_row_invariant_and_computes_what_tiles_of_f_linear_do(shape, dtype):
    """On the blocks equal_tiles allows (bf16 on a CPU with bf16 units: a weight packed once;
    float32: F.linear), every row gets the bits of F.linear on ROW_TILE-row blocks, alone or
    among any number of rows; replacing the weight repacks it."""
    K, N = shape
    torch.manual_seed(0)
    layer = nn.Linear(K, N, dtype=dtype)
    make_row_invariant(layer)
    x = torch.randn(2 * ROW_TILE + 3, K, dtype=dtype)
    with torch.inference_mode():
        out = layer(x)
        assert torch.equal(out, tiled_linear(x, layer.weight, layer.bias))
        for M in (1, 3, 4, 5, 8, 9, ROW_TILE + 1):
            assert torch.equal(layer(x[:M]), out[:M]), M
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        assert torch.equal(out, alone)
        layer.weight = nn.Parameter(layer.weight * 2, requires_grad=False)
        assert torch.equal(layer(x), tiled_linear(x, layer.weight, layer.bias))


def test_rows_go_to_full_tiles_then_to_the_smallest_tile_that_holds_the_rest():
    tiles = (4, 8, 16)
    assert block_sizes(1, tiles) == [4] and block_sizes(4, tiles) == [4]
    assert block_sizes(5, tiles) == [8] and block_sizes(9, tiles) == [16]
    assert block_sizes(16, tiles) == [16] and block_sizes(20, tiles) == [16, 4]
    assert block_sizes(41, tiles) == [16, 16, 16] and block_sizes(0, tiles) == [4]
    assert block_sizes(5, (16,)) == [16] and block_sizes(33, (16,)) == [16, 16, 16]


def test_a_block_size_whose_bits_differ_is_not_allowed():
    """A kernel whose rounding follows the block's row count (as a one-row matrix-vector
    kernel's does) keeps only the sizes that agree with ROW_TILE's."""
    weight = torch.randn(32, 64)

    def rowwise(block):  # [M, 64] -> [M, 32], each row's sum in an order of its own
        return (block.unsqueeze(1) * weight).sum(-1)

    def matmul(block):  # the same, one ulp off for blocks of 4 rows
        out = rowwise(block)
        return torch.nextafter(out, out + 1) if block.shape[0] == 4 else out
    assert equal_tiles(matmul, weight, "test-4-differs", candidates=(4, 8)) == (8, ROW_TILE)
    assert equal_tiles(matmul, weight, "test-4-differs") == tuple(
        t for t in (*SMALL_TILES, ROW_TILE) if t != 4)
    assert equal_tiles(rowwise, weight, "test-rowwise") == (*SMALL_TILES, ROW_TILE)


def test_a_chunk_of_many_rows_takes_the_smallest_wide_block_holding_it():
    assert wide_tile_for(WIDE_MIN - 1) is None and wide_tile_for(ROW_TILE + 1) is None
    assert wide_tile_for(WIDE_MIN) == WIDE_MIN and wide_tile_for(WIDE_MIN + 1) == WIDE_MIN + 16
    assert wide_tile_for(300) == 304 and wide_tile_for(MAX_TILE) == MAX_TILE


def test_a_wide_block_whose_bits_differ_is_not_allowed():
    """A kernel that rounds blocks of 64 rows or more its own way (as a CPU may switch to its
    matrix units past some size) keeps the narrower blocks only."""
    weight = torch.randn(32, 64)

    def matmul(block):
        out = (block.unsqueeze(1) * weight).sum(-1)
        return torch.nextafter(out, out + 1) if block.shape[0] >= 64 else out
    assert wide_tile_allowed(matmul, weight, "test-wide", 32)
    assert wide_tile_allowed(matmul, weight, "test-wide", 48)
    assert not wide_tile_allowed(matmul, weight, "test-wide", 64)


def spy_on_blocks(layer: RowTiledLinear, seen: list[int]) -> None:
    """From now on each block `layer` multiplies appends its row count to `seen`."""
    real = layer._prepare

    def spy():
        matmul, tiles = real()
        return (lambda block: seen.append(block.shape[0]) or matmul(block)), tiles
    layer._prepare = spy


@pytest.mark.parametrize("M", [300, MAX_TILE + 40, MAX_TILE + WIDE_MIN + 1])
def test_a_prompt_of_many_rows_takes_wide_blocks_where_allowed_and_keeps_each_row_s_bits(M):
    """A bf16 prompt's rows (Qwen 1.5B's MLP width) come out as each row alone: chunks of up
    to MAX_TILE rows, each one wide block where its size is allowed (on the EPYC all are), a
    chunk below WIDE_MIN in ROW_TILE blocks."""
    torch.manual_seed(0)
    layer = nn.Linear(1536, 1024, dtype=torch.bfloat16)
    make_row_invariant(layer)
    seen, real = [], layer._prepare
    x = torch.randn(M, 1536, dtype=torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(0, M, 9)])
        matmul, tiles = real()
        want = []
        for n in (min(MAX_TILE, M - i) for i in range(0, M, MAX_TILE)):
            wide = wide_tile_for(n)
            allowed = wide and wide_tile_allowed(matmul, layer.weight, layer._plan[3], wide)
            want += [wide] if allowed else block_sizes(n, tiles)
        spy_on_blocks(layer, seen)
        out = layer(x)
    assert torch.equal(out[::9], alone)
    assert seen == want


def test_a_layer_with_a_bias_has_its_blocks_checked_apart_from_one_without():
    """Qwen's q_proj (a bias, fused into the kernel) and o_proj (none) share a shape: what one
    kernel allows is not taken for the other."""
    layers = [nn.Linear(48, 40, bias=b) for b in (True, False)]
    with torch.inference_mode():
        for layer in layers:
            make_row_invariant(layer)
            layer(torch.randn(1, 48))
    kernels = {key[2] for key in invariant_ops._EQUAL if key[0] == (40, 48)}
    assert len(kernels) == 2 and sum(k.endswith("+bias") for k in kernels) == 1


def test_a_decode_multiplies_the_smallest_allowed_block_and_a_pinned_layer_its_tile():
    layer = nn.Linear(64, 32)
    make_row_invariant(layer)
    seen, real = [], layer._prepare
    spy_on_blocks(layer, seen)
    with torch.inference_mode():
        tiles = real()[1]
        layer(torch.randn(1, 64))
        layer(torch.randn(21, 64))  # 16 + 5: a verify's rows take no wide block
        layer.candidates = ()
        layer(torch.randn(1, 64))
        layer(torch.randn(WIDE_MIN, 64))  # pinned: 16-row blocks, never a wide one
    assert seen == [min(tiles), ROW_TILE, min(t for t in tiles if t >= 5), ROW_TILE,
                    *[ROW_TILE] * (WIDE_MIN // ROW_TILE)]


def test_tiled_linear_keeps_leading_dimensions_and_empty_inputs():
    weight, x = torch.randn(8, 4), torch.randn(2, 3, 4)
    out = tiled_linear(x, weight)
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out, F.linear(x, weight))
    assert tiled_linear(torch.randn(0, 4), weight).shape == (0, 8)


def test_make_row_invariant_converts_linears_in_place_and_keeps_the_weights():
    model = build_tiny_model(TinyModelSpec(seed=1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert make_row_invariant(model) == linears > 0
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert is_row_invariant(model.lm_head) and is_row_invariant(model.model.layers[0].mlp.up_proj)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert make_row_invariant(model) == 0  # already converted


@pytest.mark.parametrize("prune_first", [True, False])
def test_a_pruned_draft_head_stays_row_invariant_whichever_comes_first(prune_first):
    """The proposer prunes its head after the runner made the model row-invariant; the
    in-process engine prunes first. Either way the pruned head computes through a
    RowTiledLinear."""
    model = build_tiny_model(TinyModelSpec(seed=2, num_layers=1))
    if prune_first:
        prune_lm_head(model, None, 64)
        make_row_invariant(model)
    else:
        make_row_invariant(model)
        prune_lm_head(model, None, 64)
    assert isinstance(model.lm_head, PrunedLMHead) and is_row_invariant(model.lm_head.proj)
    assert isinstance(model.lm_head.proj, RowTiledLinear)


def attention_setup(dtype, kv_heads: int, groups: int, D: int, length: int):
    gen = torch.Generator().manual_seed(0)
    backend = InvariantSdpaBackend()
    kv = backend.allocate(1, kv_heads, 64, D, dtype, CPU)[0]  # [2, kv_heads, 64, D]
    kv[:, :, :length] = torch.randn(2, kv_heads, length, D, generator=gen).to(dtype)
    q = torch.randn(length, kv_heads * groups, D, generator=gen).to(dtype)
    return backend, kv, q


def attend(backend, kv, q, queries: int, kv_len: int, groups: int) -> torch.Tensor:
    """The last `queries` positions before kv_len as one row of one call."""
    batch = AttnBatch([0, queries], [0], [kv_len], torch.zeros(0, dtype=torch.long), None)
    backend.prepare(batch, groups, CPU)
    return backend.attend(q[kv_len - queries:kv_len], kv, batch, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(3, 3, 64), (2, 6, 128)])  # SmolLM2, Qwen2.5-1.5B
def test_a_query_of_a_verify_or_a_prefill_attends_as_its_decode_would(dtype, heads):
    kv_heads, groups, D = heads
    length = 37
    backend, kv, q = attention_setup(dtype, kv_heads, groups, D, length)
    decode = torch.cat([attend(backend, kv, q, 1, p + 1, groups) for p in range(length)])
    for n in (2, 5, 9):  # a verify of k+1 = n queries
        assert torch.equal(attend(backend, kv, q, n, length, groups), decode[length - n:]), n
    assert torch.equal(attend(backend, kv, q, length, length, groups), decode)  # a prefill
    assert torch.equal(attend(backend, kv, q, 16, 20, groups), decode[4:20])  # a chunk
