"""Tests for orchestrator.engine.spec_metrics (mirroring vLLM's tests/spec_decode/test_metrics.py)."""

from __future__ import annotations

import math

import pytest
import torch

from orchestrator.engine.rejection_sampler import RejectionSampler
from orchestrator.engine.step_stats import StepStats
from orchestrator.engine.spec_metrics import (AcceptanceTotals, AsyncMetricsCollector,
                                       SpecDecodeWorkerMetrics)

INTERVAL = 5.0


def fake_sampler(accepted: int = 0, emitted: int = 0, draft: int = 0,
                 spec_seqs: int = 0) -> AcceptanceTotals:
    """Totals as vLLM's tests set its sampler's counters."""
    return AcceptanceTotals(accepted_tokens=accepted, emitted_tokens=emitted,
                            draft_tokens=draft, spec_sequences=spec_seqs)


class FakeTimer:
    """A clock the test sets by hand."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def ready_collector(sampler, rank: int = 0) -> tuple[AsyncMetricsCollector, FakeTimer]:
    """A CPU collector whose interval has already passed."""
    timer = FakeTimer()
    collector = AsyncMetricsCollector(sampler, timer=timer, collect_interval_s=INTERVAL)
    collector.init_tensors(rank=rank)
    timer.now = INTERVAL + 0.1
    return collector, timer


def test_initial_call_returns_none() -> None:
    collector, _ = ready_collector(fake_sampler(10, 12, 16, 4))
    assert collector.maybe_collect_rejsample_metrics(k=4) is None


def test_second_call_returns_metrics() -> None:
    collector, _ = ready_collector(fake_sampler(10, 12, 16, 4))
    assert collector.maybe_collect_rejsample_metrics(k=4) is None
    metrics = collector.maybe_collect_rejsample_metrics(k=4)
    assert isinstance(metrics, SpecDecodeWorkerMetrics)


def test_copy_is_a_snapshot() -> None:
    """The values returned are those at the snapshot, not at the collecting call."""
    sampler = fake_sampler(10, 12, 16, 4)
    collector, _ = ready_collector(sampler)
    collector.maybe_collect_rejsample_metrics(k=4)
    sampler.accepted_tokens += 100
    sampler.draft_tokens += 100
    metrics = collector.maybe_collect_rejsample_metrics(k=4)
    assert (metrics.accepted_tokens, metrics.draft_tokens) == (10, 16)


@pytest.mark.parametrize("rank", [1, 2, 7])
def test_nonzero_rank_noop(rank: int) -> None:
    collector, _ = ready_collector(fake_sampler(10, 12, 16, 4), rank=rank)
    for _ in range(4):
        assert collector.maybe_collect_rejsample_metrics(k=4) is None


def test_noop_without_init_tensors() -> None:
    timer = FakeTimer()
    collector = AsyncMetricsCollector(fake_sampler(1, 2, 3, 3), timer=timer)
    timer.now = 100.0
    assert collector.maybe_collect_rejsample_metrics(k=1) is None
    assert collector.maybe_collect_rejsample_metrics(k=1) is None


def test_noop_until_time() -> None:
    timer = FakeTimer(0.0)  # read once at construction: the interval counts from here
    collector = AsyncMetricsCollector(fake_sampler(10, 12, 16, 4), timer=timer,
                                      collect_interval_s=INTERVAL)
    collector.init_tensors(rank=0)
    timer.now = INTERVAL - 0.1
    assert collector.maybe_collect_rejsample_metrics(k=4) is None
    assert collector.maybe_collect_rejsample_metrics(k=4) is None
    timer.now = INTERVAL + 0.1
    assert collector.maybe_collect_rejsample_metrics(k=4) is None  # starts the copy
    assert collector.maybe_collect_rejsample_metrics(k=4) is not None


def test_interval_start_is_not_reset_as_in_seed() -> None:
    """vLLM 0.4.2 sets _last_metrics_collect_time only in __init__; once the interval has
    passed, every other call returns metrics. Kept for fidelity."""
    collector, _ = ready_collector(fake_sampler(10, 12, 16, 4))
    results = [collector.maybe_collect_rejsample_metrics(k=4) for _ in range(6)]
    assert [r is not None for r in results] == [False, True] * 3


def test_restart_interval_collects_once_per_interval() -> None:
    """For periodic logging: the interval restarts at each copy, so after one collection
    the next waits a whole interval."""
    timer = FakeTimer(0.0)
    collector = AsyncMetricsCollector(fake_sampler(10, 12, 16, 4), timer=timer,
                                      collect_interval_s=INTERVAL, restart_interval=True)
    collector.init_tensors(rank=0)
    timer.now = INTERVAL
    results = [collector.maybe_collect_rejsample_metrics(k=4) for _ in range(6)]
    assert [r is not None for r in results] == [False, True, False, False, False, False]
    timer.now = 2 * INTERVAL
    assert collector.maybe_collect_rejsample_metrics(k=4) is None
    assert collector.maybe_collect_rejsample_metrics(k=4) is not None


@pytest.mark.parametrize("accepted,emitted,draft,spec_seqs,k", [
    (0, 0, 0, 0, 4),  # nothing yet: both rates NaN
    (10, 12, 16, 4, 4),  # fixed k: spec_seqs = draft // k
    (16, 20, 16, 4, 4),  # everything accepted: efficiency 1
    (0, 4, 16, 4, 4),  # nothing accepted: one token per sequence
    (3, 7, 5, 3, 2),  # ragged proposals (2, 2, 1): draft 5 is not a multiple of k
    (5, 9, 5, 5, 1),
])
def test_has_correct_metrics(accepted: int, emitted: int, draft: int, spec_seqs: int,
                             k: int) -> None:
    collector, _ = ready_collector(fake_sampler(accepted, emitted, draft, spec_seqs))
    assert collector.maybe_collect_rejsample_metrics(k) is None
    metrics = collector.maybe_collect_rejsample_metrics(k)
    assert (metrics.accepted_tokens, metrics.emitted_tokens, metrics.draft_tokens,
            metrics.num_spec_tokens) == (accepted, emitted, draft, k)
    expected_acceptance = accepted / draft if draft else math.nan
    max_emitted = spec_seqs * (k + 1)
    expected_efficiency = emitted / max_emitted if max_emitted else math.nan
    assert metrics.draft_acceptance_rate == pytest.approx(expected_acceptance, nan_ok=True)
    assert metrics.system_efficiency == pytest.approx(expected_efficiency, nan_ok=True)
    assert isinstance(metrics.accepted_tokens, int) and isinstance(metrics.emitted_tokens, int)


@pytest.mark.parametrize("draft,spec_seqs,nan_acceptance,nan_efficiency", [
    (0, 2, True, False),  # only n_i = 0 rows (non-strict sampler): no draft tokens
    (4, 0, False, True),  # no sequences counted
])
def test_each_nan_has_its_own_denominator(draft, spec_seqs, nan_acceptance,
                                          nan_efficiency) -> None:
    collector, _ = ready_collector(fake_sampler(0, 2, draft, spec_seqs))
    collector.maybe_collect_rejsample_metrics(k=3)
    metrics = collector.maybe_collect_rejsample_metrics(k=3)
    assert math.isnan(metrics.draft_acceptance_rate) == nan_acceptance
    assert math.isnan(metrics.system_efficiency) == nan_efficiency


def test_efficiency_matches_seed_formula_for_fixed_k() -> None:
    for draft, k in [(16, 4), (30, 3), (7, 1)]:
        spec_seqs = draft // k
        collector, _ = ready_collector(fake_sampler(1, 5, draft, spec_seqs))
        collector.maybe_collect_rejsample_metrics(k)
        metrics = collector.maybe_collect_rejsample_metrics(k)
        seed_max = AsyncMetricsCollector.get_max_num_emitted_tokens(draft, k)
        assert metrics.system_efficiency == pytest.approx(5 / seed_max)


@pytest.mark.parametrize("draft,k,expected", [(0, 1, 0), (16, 4, 20), (30, 3, 40), (7, 1, 14)])
def test_get_max_num_emitted_tokens(draft: int, k: int, expected: int) -> None:
    assert AsyncMetricsCollector.get_max_num_emitted_tokens(draft, k) == expected


@pytest.mark.parametrize("draft,k", [(5, 2), (7, 4), (3, 0)])
def test_get_max_num_emitted_tokens_rejects_ragged(draft: int, k: int) -> None:
    with pytest.raises(ValueError, match="multiple of k"):
        AsyncMetricsCollector.get_max_num_emitted_tokens(draft, k)


def test_with_real_sampler_and_step_stats() -> None:
    """End to end: the real sampler's per-row counts, summed into step stats and totals."""
    out, accepted = RejectionSampler().greedy(torch.tensor([[1, 2, 3], [4, 0, 6]]),
                                              torch.tensor([[1, 2], [4, 5]]))
    assert out.tolist() == [[1, 2, 3], [4, 0, -1]]
    totals = AcceptanceTotals()
    collector, _ = ready_collector(totals)
    totals.add(StepStats(k=2, draft_tokens=4, accepted_tokens=int(accepted.sum()),
                         emitted_tokens=int((out != -1).sum()), spec_sequences=2))
    assert collector.maybe_collect_rejsample_metrics(k=2) is None
    metrics = collector.maybe_collect_rejsample_metrics(k=2)
    assert metrics == SpecDecodeWorkerMetrics(
        draft_acceptance_rate=3 / 4, system_efficiency=5 / 6, draft_tokens=4,
        emitted_tokens=5, accepted_tokens=3, num_spec_tokens=2)
    assert (totals.draft_acceptance_rate, totals.system_efficiency) == (3 / 4, 5 / 6)
