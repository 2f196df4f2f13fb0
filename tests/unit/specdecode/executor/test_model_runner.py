"""The model runner's cache: ragged rows with hits, rollbacks and misses, a cache that
disagrees with the sequence, least-recent eviction."""

from __future__ import annotations

import torch

from specdecode.executor.model_runner import ModelRunner, RunnerRow
from tests.support.models import CPU
from tests.support.references import full_logits


def test_runner_batches_ragged_rows_with_cache_hits_rollbacks_and_misses(target_model):
    runner = ModelRunner(target_model, CPU)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 9, 3, 12)]
    for step in range(3):
        rows = [RunnerRow(i, s, min(3, len(s))) for i, s in enumerate(seqs)]
        for row, got in zip(rows, runner.forward(rows)):
            want = full_logits(target_model, row.token_ids)[-row.num_queries:]
            assert torch.allclose(got, want, atol=1e-4), step
        # Even rows grow (cache hit); odd rows replace their last token (rollback).
        seqs = [s + [7, 8] if i % 2 == 0 else s[:-1] + [9, 10, 11] for i, s in enumerate(seqs)]
    assert runner.stats.cache_misses == 4 and runner.stats.cache_hits == 8
    # A prefix-sharing row set (batch expansion) reads one entry; the longest is kept.
    rows = [RunnerRow(0, seqs[0] + [1, 2, 3][:j], 1) for j in range(4)]
    for row, got in zip(rows, runner.forward(rows)):
        assert torch.allclose(got, full_logits(target_model, row.token_ids)[-1:], atol=1e-4)
    assert runner.release([0, 1, 99]) == 2 and runner.num_cached_sequences == 2


def test_runner_recomputes_when_cache_disagrees(target_model):
    runner = ModelRunner(target_model, CPU)
    runner.forward([RunnerRow(0, [1, 2, 3, 4], 1)])
    # Same id, different history (e.g. another replica served the last step): miss.
    (got,) = runner.forward([RunnerRow(0, [9, 9, 9, 9, 9], 1)])
    assert runner.stats.cache_hits == 0 and runner.stats.cache_misses == 2
    assert torch.allclose(got, full_logits(target_model, [9, 9, 9, 9, 9])[-1:], atol=1e-4)


def test_runner_evicts_least_recent(target_model):
    runner = ModelRunner(target_model, CPU, max_num_seqs=2)
    for i in range(3):
        runner.forward([RunnerRow(i, [1, 2, 3], 1)])
    assert runner.num_cached_sequences == 2 and runner.release([0]) == 0
