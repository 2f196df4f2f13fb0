"""A forward-cost table kept across restarts (issue 32: a restart spent ~80 s timing cells it
had timed before): kept under a key of what its times depend on, taken back only when a probe
agrees with it, re-timed and replaced when not. A real runner on a tiny random model; the
tables that must be refused are 50x off, far beyond timing noise."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest
import torch

from specdecode.cost_model import ForwardCosts
from specdecode.executor import cost_cache as cc
from specdecode.executor.calibration import calibrate, calibration_widths
from specdecode.executor.model_runner import ModelRunner
from specdecode.models.model_loading import ModelOptions
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model
from specdecode.serving.model_access import ModelAccess
from specdecode.serving.recalibration import Recalibrator

WIDTHS = calibration_widths(3)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(build_tiny_model(TinyModelSpec(seed=1)), torch.device("cpu"))


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"x" * 100)
    return path


def cache_for(directory, model_dir, **options) -> cc.CostCache:
    options = ModelOptions(str(model_dir), **options)
    return cc.cost_cache(str(directory), model_dir, "scorer", options, device="cpu")


def scaled(costs: ForwardCosts, factor: float) -> ForwardCosts:
    return ForwardCosts(costs.rows, costs.tokens, [[factor * s for s in r] for r in costs.seconds])


def test_a_table_is_kept_under_what_its_times_depend_on(tmp_path, model_dir):
    cache = cache_for(tmp_path / "c", model_dir, dtype="bfloat16")
    assert cc.cost_cache(None, model_dir, "scorer", ModelOptions(str(model_dir))) is None
    assert cache.load() is None  # nothing kept yet
    table = ForwardCosts([1, 4], [1, 2], [[0.1, 0.2], [0.3, 0.4]])
    cache.save(table)
    assert cache.load() == table
    assert cache.key["host"]["threads"] == torch.get_num_threads()
    # Another dtype, role, or checkpoint under the same path: not this table.
    assert cache_for(tmp_path / "c", model_dir, dtype="float32").load() is None
    other_role = dataclasses.replace(cache, key={**cache.key, "role": "proposer"})
    assert other_role.load() is None
    (model_dir / "model.safetensors").write_bytes(b"x" * 101)
    assert cache_for(tmp_path / "c", model_dir, dtype="bfloat16").load() is None
    # A file that is not a table is ignored, not raised.
    cache.path.write_text("{not json")
    assert cache.load() is None
    assert [p.name for p in cache.directory.iterdir()] == [cache.path.name]  # no temp files


def test_a_kept_table_far_off_this_host_is_timed_again_and_replaced(tmp_path, model_dir, runner):
    """Kept 50x too dear or 50x too cheap (another host under the same key, a load that came
    or went): the probe disagrees, every cell is timed, and the new table is kept."""
    true = calibrate(runner, tokens=WIDTHS)
    for factor in (50.0, 1 / 50):
        cache = cache_for(tmp_path / str(factor), model_dir)
        cache.save(scaled(true, factor))
        costs = cc.calibrate_or_reuse(runner, cache, WIDTHS)
        assert 0.2 < costs(1, 1) / true(1, 1) < 5
        assert cache.load() == costs
    assert runner.num_cached_sequences == 0  # the probes' rows released


def test_a_kept_table_the_probe_agrees_with_is_taken_without_timing_a_cell(
        tmp_path, model_dir, runner, monkeypatch):
    """The agreement itself is timing (the test above shows it refusing a table 50x off);
    here it agrees, and nothing else is timed: the kept table is the one served."""
    cache = cache_for(tmp_path, model_dir)
    kept = ForwardCosts([1, 4], list(WIDTHS), [[0.01, 0.02, 0.03], [0.04, 0.05, 0.06]])
    cache.save(kept)
    monkeypatch.setattr(cc, "agrees", lambda runner, table: table == kept)
    monkeypatch.setattr(cc, "calibrate", lambda *a, **kw: pytest.fail("timed every cell"))
    assert cc.calibrate_or_reuse(runner, cache, WIDTHS) == kept
    # A table of another grid (a wider --calibration-width) is not taken.
    monkeypatch.setattr(cc, "calibrate", lambda runner, tokens: ForwardCosts(
        [1], list(tokens), [[0.01] * len(tokens)]))
    wider = calibration_widths(4)
    assert cc.calibrate_or_reuse(runner, cache, wider).tokens == list(wider)
    assert cache.load().tokens == list(wider)


def test_each_re_measured_table_is_kept(tmp_path, model_dir, runner):
    """The service's idle re-measurement replaces the kept table with each new version: a
    restart then starts from what the host was last measured to do."""
    cache = cache_for(tmp_path, model_dir)
    busy = scaled(calibrate(runner, rows=(1,), tokens=(1, 2), repeats=2), 50.0)
    cache.save(busy)
    access = ModelAccess()
    access.last_call = time.monotonic() - 3600

    class Quiet:
        def busy(self) -> bool:
            return False
    recalibrator = Recalibrator(runner, busy, access, idle_s=1.0, probe_s=0.0, host=Quiet(),
                                on_replace=cache.save)

    async def steps() -> list[bool]:
        return [await recalibrator.step(), await recalibrator.step()]
    assert asyncio.run(steps()) == [False, True]
    kept = json.loads(cache.path.read_text())
    assert kept["seconds"] == busy.snapshot().seconds and busy.version == 1
