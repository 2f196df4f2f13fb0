"""The executor: the KV pool's allocator, and the runner's fast (Llama, Qwen2) and generic paths
over it, against the model's own full recomputation."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from specdecode.executor.kv_pool import KVPool, PoolFull
from specdecode.executor.model_runner import ModelRunner, RunnerRow
from tests.support.models import CPU
from tests.support.references import full_logits


@pytest.fixture(scope="module")
def qwen2_gqa():
    """Qwen2 with grouped-query attention (4 query heads per 2 key/value heads) and q/k/v bias."""
    torch.manual_seed(5)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.3,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(6)
    config = GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=256,
                        initializer_range=0.3)
    return GPT2LMHeadModel(config).eval()


def pool(blocks: int, max_num_seqs: int = 8) -> KVPool:
    """A pool of `blocks` blocks of 4 tokens; slot t holds the value t while it is valid."""
    return KVPool(torch.zeros(1, 2, 1, blocks * 4, 1), token_dim=3, block_size=4,
                  max_num_seqs=max_num_seqs)


def fill(p: KVPool, cache_id: int, tokens: list[int]) -> None:
    """What the runner does after a forward: write the tokens' values, record them."""
    e = p.get(cache_id)
    p.kv[..., e.start:e.start + len(tokens), :] = torch.tensor(tokens, dtype=torch.float)[:, None]
    e.token_ids[:] = tokens


def held(p: KVPool, cache_id: int) -> list[int]:
    e = p.get(cache_id)
    return p.kv[0, 0, 0, e.start:e.start + len(e.token_ids), 0].long().tolist()


def test_pool_rolls_back_by_length_grows_relocates_compacts_and_evicts_lru():
    p = pool(blocks=10)
    p.reserve(1, 6, keep=0, pinned={1})  # 2 blocks + 1 headroom
    fill(p, 1, list(range(6)))
    p.reserve(2, 4, keep=0, pinned={2})
    fill(p, 2, [7, 7, 7, 7])
    # Rollback: keep 3 of 6 tokens, no copy.
    e = p.reserve(1, 5, keep=3, pinned={1})
    assert e.token_ids == [0, 1, 2] and held(p, 1) == [0, 1, 2]
    # Growing past the extent while the next blocks are taken: moved once, contents kept.
    fill(p, 1, [0, 1, 2, 3, 4])
    e = p.reserve(1, 14, keep=5, pinned={1})
    assert p.stats.relocations == 1 and e.capacity >= 14 and held(p, 1) == [0, 1, 2, 3, 4]
    assert held(p, 2) == [7, 7, 7, 7]
    assert p.tokens_reserved <= p.capacity_tokens
    # No room for 4 more blocks beside pinned 1 ... unless the unpinned 2 is evicted.
    p.reserve(3, 16, keep=0, pinned={3, 1})
    assert p.get(2) is None and p.stats.evictions == 1 and held(p, 1) == [0, 1, 2, 3, 4]
    with pytest.raises(PoolFull):
        p.reserve(4, 20, keep=0, pinned={1, 3, 4})
    assert p.release([1, 3, 99]) == 2 and p.tokens_reserved == 0 and p._free == [(0, 10)]


def test_pool_compacts_a_fragmented_pool_before_giving_up():
    p = pool(blocks=12, max_num_seqs=8)
    for i in range(6):
        p.reserve(i, 4, keep=0, pinned={i})  # one block and one of headroom each
        fill(p, i, [10 * i + j for j in range(4)])
    p.release([0, 2, 4])  # three free runs of 2 blocks, none adjacent
    p.reserve(9, 16, keep=0, pinned={1, 3, 5, 9})
    assert p.stats.compactions == 1 and p.stats.evictions == 0
    assert [held(p, i) for i in (1, 3, 5)] == [[10, 11, 12, 13], [30, 31, 32, 33],
                                              [50, 51, 52, 53]]


def test_pool_trims_growth_room_outside_the_batch_before_evicting():
    p = pool(blocks=8)
    for i in (1, 2):
        p.reserve(i, 8, keep=0, pinned={i})  # 2 blocks + 1 of growth room each
        fill(p, i, [i] * 8)
    p.reserve(3, 12, keep=0, pinned={3})  # 3 blocks: only 2 are free until 1 and 2 are trimmed
    assert p.stats.evictions == 0 and held(p, 1) == [1] * 8 and held(p, 2) == [2] * 8
    assert p.tokens_reserved == 28  # 2 + 2 + 3 blocks; one trimmed block is left over


def check_steps(runner, model, seqs, steps=3):
    for step in range(steps):
        rows = [RunnerRow(i, s, min(3, len(s))) for i, s in enumerate(seqs)]
        for row, got in zip(rows, runner.forward(rows)):
            want = full_logits(model, row.token_ids)[-row.num_queries:]
            assert torch.allclose(got, want, atol=1e-4), (step, row.cache_id)
        seqs = [s + [7, 8] if i % 2 == 0 else s[:-1] + [9, 10, 11] for i, s in enumerate(seqs)]
    return seqs


@pytest.mark.parametrize("model_name", ["qwen2_gqa", "gpt2"])
def test_fast_and_generic_paths_match_full_recompute(model_name, request):
    model = request.getfixturevalue(model_name)
    runner = ModelRunner(model, CPU)
    assert (runner.fast is not None) == (model_name == "qwen2_gqa")
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 9, 3, 12)]
    seqs = check_steps(runner, model, seqs)
    assert runner.stats.cache_misses == 4 and runner.stats.cache_hits == 8
    # Batch expansion: rows sharing a cache id, one not a prefix of the others (private entry).
    rows = [RunnerRow(0, seqs[0] + [1, 2, 3][:j], 1) for j in range(4)] + \
        [RunnerRow(0, seqs[0][:-1] + [5], 2)]
    for row, got in zip(rows, runner.forward(rows)):
        assert torch.allclose(got, full_logits(model, row.token_ids)[-row.num_queries:], atol=1e-4)
    assert runner.pool.get(0).token_ids == seqs[0] + [1, 2, 3] and runner.num_cached_sequences == 4


def test_a_small_budget_evicts_splits_batches_and_still_answers(target_model):
    """Room for ~2 sequences of 40 tokens: a batch of 4 runs in parts, evicted sequences are
    recomputed, the pool never grows."""
    runner = ModelRunner(target_model, CPU, kv_cache_memory=100 * 1024)  # 1 KiB per token
    assert runner.pool.capacity_tokens == 96 and runner.max_model_len == 96
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (40,), generator=gen).tolist() for _ in range(4)]
    check_steps(runner, target_model, seqs, steps=2)
    assert runner.pool.stats.evictions > 0 and runner.pool.nbytes <= 100 * 1024
    with pytest.raises(ValueError, match="token_ids: 97 tokens exceed max_model_len 96"):
        runner.forward([RunnerRow(0, [1] * 97, 1)])


def test_kv_cache_memory_sizes_parse_and_bad_ones_name_the_problem():
    from specdecode.models.model_loading import parse_size
    assert parse_size("4GiB") == 4 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1e9") == 10**9 and parse_size("2GB") == 2 * 10**9
    for bad in ("lots", "4XB", "0"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_size(bad)
