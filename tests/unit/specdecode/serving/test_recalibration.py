"""Forward-cost tables that stay true to their host (issue 20): every width timed, the envelope
across rows only, and re-measured while the service is idle when they drift. Real runners on
a tiny random model; thresholds are far from timing noise (a table 50x off)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from specdecode.cost_model import DRIFT, DRIFT_RUN, ForwardCosts
from specdecode.executor.calibration import calibrate, calibration_widths
from specdecode.serving.host_load import HostLoad
from specdecode.serving.model_access import ForwardStopped, ModelAccess
from specdecode.executor.model_runner import ModelRunner
from specdecode.serving import recalibration
from specdecode.serving.recalibration import Recalibrator, merged_rows
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model

CPU = torch.device("cpu")


class Host:
    """A host whose other processes are busy or not, as the test says (the real HostLoad
    reads the machine: beside a test suite or busy loops it would always say busy)."""

    def __init__(self, busy: bool = False):
        self.busy_now = busy

    def busy(self) -> bool:
        return self.busy_now


QUIET = Host()


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(build_tiny_model(TinyModelSpec(seed=1)), CPU)


def scaled(costs: ForwardCosts, factor: float) -> ForwardCosts:
    return ForwardCosts(list(costs.rows), list(costs.tokens),
                        [[factor * s for s in line] for line in costs.seconds])


def idle_access() -> ModelAccess:
    model = ModelAccess()
    model.last_call = time.monotonic() - 3600  # no call for an hour
    return model


def test_every_width_up_to_the_widest_is_timed(runner):
    assert calibration_widths(9) == tuple(range(1, 10))
    assert calibration_widths(5, catch_up=True) == (1, 2, 3, 4, 5, 10, 20, 40)
    costs = calibrate(runner, rows=(1, 2), tokens=calibration_widths(4), repeats=1, context=8)
    assert costs.tokens == [1, 2, 3, 4] and costs.max_width == 4 and costs.version == 0
    assert runner.num_cached_sequences == 0


def test_a_table_measured_on_a_busy_host_is_remeasured_while_idle(runner):
    """A table 50x too dear (timed while other work held the cores): two probe decodes in a
    row off by more than DRIFT, then every cell re-measured, a new version."""
    true = calibrate(runner, rows=(1,), tokens=(1, 2, 3), repeats=2)
    busy = scaled(true, 50.0)
    recalibrator = Recalibrator(runner, busy, idle_access(), idle_s=1.0, probe_s=0.0, host=QUIET)

    async def run() -> list[bool]:
        return [await recalibrator.step(), await recalibrator.step()]
    assert asyncio.run(run()) == [False, True]  # the first probe is confirmed by a second
    assert busy.version == 1 and busy.tokens == [1, 2, 3]
    assert busy(1, 1) < 0.2 * 50 * true(1, 1)


def test_a_table_whose_wide_cells_alone_are_off_is_remeasured(runner):
    """Load that inflated the wide forwards only (the decode cell right): the probe's wide
    forward finds it, twice in a row, and the whole table is re-measured."""
    true = calibrate(runner, rows=(1,), tokens=(1, 2, 3), repeats=2)
    busy = ForwardCosts([1], [1, 2, 3], [[true(1, 1), 50 * true(1, 2), 50 * true(1, 3)]])
    recalibrator = Recalibrator(runner, busy, idle_access(), idle_s=1.0, probe_s=0.0, host=QUIET)

    async def run() -> list[bool]:
        return [await recalibrator.step(), await recalibrator.step()]
    assert asyncio.run(run()) == [False, True]
    assert busy.version == 1 and busy(1, 3) < 0.2 * 50 * true(1, 3)
    assert runner.num_cached_sequences == 0


class HostTimes:
    """A Calibration on a host whose forwards take exactly `true`'s times (the decision
    without timing noise: a re-measure of millisecond forwards beside a test suite varies
    by more than DRIFT)."""

    def __init__(self, true: ForwardCosts):
        self.true = true

    def __call__(self, runner, rows, tokens, context=0):
        return self

    def cell(self, rows: int, tokens: int) -> float:
        return self.true(rows, tokens)

    def close(self) -> None:
        pass


def test_traffic_that_reads_dearer_than_idle_does_not_churn_versions(runner, monkeypatch):
    """Live forwards beside the other service's read dearer than the idle table (here 3x):
    the live cells follow them and the table turns stale, but re-measured while idle it is
    the table measured before -- no new version, and no probe finds it off afterwards.
    Held against the live cells, each idle spell published a new version (CI: x0.62 every
    20 s), and each adoption wiped what the orchestrator's policy had learned. A host that
    did change (2x) is published."""
    true = ForwardCosts([1], [1, 2, 3], [[0.010, 0.012, 0.013]])
    monkeypatch.setattr(recalibration, "Calibration", HostTimes(true))
    costs = true.snapshot()
    recalibrator = Recalibrator(runner, costs, idle_access(), idle_s=1.0, probe_s=0.0, host=QUIET)
    for _ in range(DRIFT_RUN):  # traffic: every forward at 3x its idle cell's time
        for w in costs.tokens:
            costs.observe(1, w, 3 * true(1, w))
    assert costs.stale() and costs(1, 2) > 1.5 * true(1, 2)

    async def steps() -> list[bool]:
        return [await recalibrator.step() for _ in range(3)]
    assert asyncio.run(steps()) == [False] * 3
    assert costs.version == 0 and not costs.stale() and recalibrator.off == 0
    monkeypatch.setattr(recalibration, "Calibration", HostTimes(scaled(true, 2.0)))
    assert asyncio.run(steps()) == [False, True, False]  # two probes off, then re-measured
    assert costs.version == 1 and costs(1, 2) == pytest.approx(0.024)


def test_a_call_stops_the_remeasurement(runner):
    """Traffic first: a call arriving while the table is re-measured stops the cell being
    timed, and the re-measurement gives up (it is tried again at the next idle spell)."""
    model = idle_access()
    busy = scaled(calibrate(runner, rows=(1,), tokens=(1, 2, 3, 4), repeats=1), 50.0)
    busy.observe(3, 1, 1.0)  # stale: traffic ran a row count the grid lacks
    recalibrator = Recalibrator(runner, busy, model, idle_s=1.0, host=QUIET)

    async def run() -> bool:
        measuring = asyncio.create_task(recalibrator.step())
        await asyncio.sleep(0)  # it takes the model for its first cell
        await model.run(lambda: None)  # a call: stops that cell, then runs
        return await measuring
    assert asyncio.run(run()) is False and busy.version == 0 and busy.rows == [1]
    assert runner.num_cached_sequences == 0  # the stopped cell's cache entries are gone


def test_traffic_never_waits_for_the_services_own_work():
    """A traffic call stops the service's own call (re-measuring) at its next module, and
    an own call that waited while traffic came does not start (issue 31: a step that waited
    for a calibration cell taught the orchestrator that speculation costs 20x what it does).
    The own call here would run for 20 s."""
    model = ModelAccess()
    layer = torch.nn.Linear(4, 4)
    started, release = threading.Event(), threading.Event()

    def own_work() -> str:
        started.set()
        end = time.monotonic() + 20
        while time.monotonic() < end:
            layer(torch.zeros(1, 4))
        return "ran to its end"

    async def run() -> None:
        own = asyncio.create_task(model.run(own_work, traffic=False))
        await asyncio.to_thread(started.wait)
        assert await model.run(lambda: "served") == "served"
        with pytest.raises(ForwardStopped):
            await own
        traffic = asyncio.create_task(model.run(release.wait))  # holds the model ...
        await asyncio.sleep(0)
        queued = asyncio.create_task(model.run(lambda: "measured", traffic=False))
        await asyncio.sleep(0)
        release.set()  # ... until now: the own call that waited gives way
        assert await traffic is True
        with pytest.raises(ForwardStopped):
            await queued
        assert await model.run(lambda: "measured", traffic=False) == "measured"  # no traffic
    asyncio.run(asyncio.wait_for(run(), 10))


def test_drift_and_new_row_counts_in_traffic_make_a_table_stale(runner):
    costs = ForwardCosts([1], [1, 2], [[0.01, 0.012]])
    for _ in range(DRIFT_RUN - 1):
        costs.observe(1, 1, 0.01 * DRIFT * 2)
    assert not costs.stale()
    costs.observe(1, 2, 0.012 / (DRIFT * 2))  # drift either way counts
    assert costs.stale()
    costs.replace(None)  # re-measured and found right: no new version, evidence cleared
    assert not costs.stale() and costs.version == 0
    costs.observe(3, 2, 0.05)  # a 3-row verify: a row count the grid lacks
    assert costs.stale() and costs.rows_seen == {3}
    assert merged_rows([1, 4], {2, 3, 5, 9, 12, 16, 20, 33, 40}) == [1, 2, 3, 4, 5, 9, 12, 40]


def test_a_table_that_ran_cheaper_stays_too_dear_until_it_is_replaced():
    """Live decodes DRIFT_RUN in a row cheaper than their cell (a start-up table timed under
    heavier load): the cell follows them, so later ones read right, and the evidence that
    the table was too dear used to end with the run; traffic that never paused for as long
    saw it gone by the time it idled, and the verify cells no traffic ran stayed dear."""
    costs = ForwardCosts([1], [1, 2], [[0.1, 1.0]])
    for _ in range(40):
        costs.observe(1, 1, 0.01)
    assert costs(1, 1) < 0.01 * DRIFT and costs._cheaper == 0  # the cell has followed
    assert costs.too_dear() and costs.stale()
    costs.replace(None)
    assert not costs.too_dear() and not costs.stale()


def test_row_counts_seen_in_traffic_are_measured_when_idle(runner):
    costs = calibrate(runner, rows=(1,), tokens=(1, 2), repeats=1)
    costs.observe(3, 2, 1.0)  # traffic ran 3 rows
    recalibrator = Recalibrator(runner, costs, idle_access(), idle_s=1.0, host=QUIET)
    assert asyncio.run(recalibrator.step()) is True
    assert costs.rows == [1, 3] and costs.version == 1 and not costs.stale()


def test_no_probe_or_remeasure_while_other_work_holds_the_host(runner):
    """The service idle but the host busy (the other service's traffic on the same cores):
    nothing is timed, since it would slow that traffic and read the table dear; the same
    stale table is re-measured once the host is idle too."""
    true = calibrate(runner, rows=(1,), tokens=(1, 2, 3), repeats=2)
    busy = scaled(true, 50.0)
    host = Host(busy=True)
    recalibrator = Recalibrator(runner, busy, idle_access(), idle_s=1.0, probe_s=0.0, host=host,
                                backoff_s=0.0)

    async def steps(n: int) -> list[bool]:
        return [await recalibrator.step() for _ in range(n)]
    assert asyncio.run(steps(3)) == [False] * 3 and recalibrator.off == 0 and busy.version == 0
    host.busy_now = False
    assert asyncio.run(steps(2)) == [False, True] and busy.version == 1


def test_a_stale_table_is_remeasured_under_a_load_that_lasts(runner):
    """Traffic ran row counts the table lacks (stale) while other work keeps the host busy
    at every check: nothing is timed until the load has lasted lasting_s, then the table is
    re-measured under it (the load is the host's condition)."""
    stale = calibrate(runner, rows=(1,), tokens=(1, 2), repeats=1)
    stale.observe(3, 2, 1.0)  # traffic ran 3 rows
    recalibrator = Recalibrator(runner, stale, idle_access(), idle_s=1.0, probe_s=0.0,
                                host=Host(busy=True), backoff_s=0.0, lasting_s=0.3)

    async def steps(n: int) -> list[bool]:
        return [await recalibrator.step() for _ in range(n)]
    assert asyncio.run(steps(2)) == [False, False] and stale.version == 0
    time.sleep(0.35)
    assert asyncio.run(steps(1)) == [True] and stale.rows == [1, 3] and stale.version == 1


def test_under_a_lasting_load_probes_remeasure_only_a_table_too_dear(runner):
    """No traffic, other work busy at every check for lasting_s: a start-up table timed
    under a heavier load (50x too dear) is probed, two probes in a row read it cheaper, and
    it is re-measured under the lasting load (before, nothing was probed under any load, and
    a stack started under four busy loops kept its 6-12x verify cells, decoding plainly,
    for as long as two loops ran beside it: CI beside busy loops). A table that probes read
    dearer (5x too cheap: timed on a quiet host, probed beside the load) waits for a quiet
    host, however long the load lasts."""
    true = calibrate(runner, rows=(1,), tokens=(1, 2, 3), repeats=2)
    dear, cheap = scaled(true, 50.0), scaled(true, 0.2)
    recalibrators = [Recalibrator(runner, costs, idle_access(), idle_s=1.0, probe_s=0.0,
                                  host=Host(busy=True), backoff_s=0.0, lasting_s=0.0)
                     for costs in (dear, cheap)]

    async def steps(n: int) -> list[list[bool]]:
        return [[await r.step() for r in recalibrators] for _ in range(n)]
    assert asyncio.run(steps(3)) == [[False, False], [True, False], [False, False]]
    assert dear.version == 1 and dear(1, 1) < 0.2 * 50 * true(1, 1)
    assert cheap.version == 0 and recalibrators[1].off >= 1 and recalibrators[1].cheaper == 0


def test_a_stale_table_is_remeasured_under_a_load_that_comes_and_goes(runner):
    """Stale, beside work that is busy at every other check: each busy check renews the
    back-off and the quiet ones fall inside it, so without a bound the table waited for
    ever (CI's proposer: no re-measurement in 50 s after traffic of 2 and 3 rows); held back
    lasting_s in all, it is re-measured under the load. A table that probes read dearer
    (too cheap) is never re-measured beside that load."""

    class Flickering(Host):
        def busy(self) -> bool:
            self.busy_now = not self.busy_now
            return self.busy_now

    stale = calibrate(runner, rows=(1,), tokens=(1, 2), repeats=1)
    stale.observe(3, 2, 1.0)  # traffic ran 3 rows
    cheap = scaled(calibrate(runner, rows=(1,), tokens=(1, 2), repeats=1), 0.2)
    recalibrators = [Recalibrator(runner, costs, idle_access(), idle_s=1.0, probe_s=0.0,
                                  host=Flickering(), backoff_s=60.0, lasting_s=0.3)
                     for costs in (stale, cheap)]

    async def steps(n: int) -> list[list[bool]]:
        return [[await r.step() for r in recalibrators] for _ in range(n)]
    assert asyncio.run(steps(3)) == [[False, False]] * 3 and stale.version == 0
    time.sleep(0.35)
    assert asyncio.run(steps(2)) == [[True, False], [False, False]]
    assert stale.rows == [1, 3] and stale.version == 1 and cheap.version == 0


def test_under_a_lasting_load_only_a_table_too_dear_is_remeasured(runner):
    """Live forwards off their cells by DRIFT, DRIFT_RUN in a row, under a load that lasts:
    running cheaper (a table taken on a busy host, which keeps speculation off), the table is
    re-measured under the load; running dearer (timed beside the other service's decodes on a
    shared host), it waits for a quiet host: a proposer that timed its table under that load
    slowed the scorer's plain decodes for 45 s and published a table x1.98 dearer."""
    tables = [calibrate(runner, rows=(1,), tokens=(1, 2), repeats=1) for _ in range(2)]
    for costs, factor in zip(tables, (1 / (2 * DRIFT), 2 * DRIFT)):  # cheaper, dearer
        for _ in range(DRIFT_RUN):
            costs.observe(1, 1, factor * costs(1, 1))
    cheaper, dearer = tables
    assert cheaper.stale() and dearer.stale()
    assert cheaper.too_dear() and not dearer.too_dear()
    recalibrators = [Recalibrator(runner, costs, idle_access(), idle_s=1.0, probe_s=0.0,
                                  host=Host(busy=True), backoff_s=0.0, lasting_s=0.3)
                     for costs in tables]

    async def steps(n: int) -> list[list[bool]]:
        return [[await r.step() for r in recalibrators] for _ in range(n)]
    assert asyncio.run(steps(2)) == [[False, False]] * 2
    time.sleep(0.35)
    results = asyncio.run(steps(2))
    assert cheaper.version == 1 or not cheaper.stale()  # re-measured (a new table, or right)
    assert [r[1] for r in results] == [False, False] and dearer.stale()


def test_a_busy_host_holds_the_timing_back_for_a_while(runner):
    """Busy once, then quiet: nothing is timed until the back-off (half to all of backoff_s)
    has passed: two services that found each other's timing as load do not start again
    together (without the hold the second step would re-measure)."""
    busy = scaled(calibrate(runner, rows=(1,), tokens=(1, 2), repeats=1), 50.0)
    host = Host(busy=True)
    recalibrator = Recalibrator(runner, busy, idle_access(), idle_s=1.0, probe_s=0.0, host=host,
                                backoff_s=0.4)

    async def steps(n: int) -> list[bool]:
        return [await recalibrator.step() for _ in range(n)]
    assert asyncio.run(steps(1)) == [False]
    host.busy_now = False
    assert asyncio.run(steps(2)) == [False, False] and busy.version == 0
    time.sleep(0.45)
    assert asyncio.run(steps(2)) == [False, True] and busy.version == 1


def test_host_load_counts_other_processes_only():
    """Busy CPU seconds of the allowed CPUs less this process's own CPU time, over the wall
    time and the CPU count: 1.5 s of others' work on 2 CPUs in ~0.05 s reads far above the
    threshold; this process's own work alone reads 0, in each reading over its own work (a
    reading right after another divides the microsecond between its two clocks by a
    microsecond's wall time: the suite once read it busy)."""
    readings = iter([10.0, 11.5])
    load = HostLoad({0, 1}, read=lambda cpus: next(readings))
    time.sleep(0.05)
    assert load.others_busy() > 1.0
    load = HostLoad({0}, read=lambda cpus: time.process_time())  # all of it this process's
    sum(i * i for i in range(200_000))
    assert load.others_busy() < 0.05
    sum(i * i for i in range(200_000))
    assert not load.busy()
    assert HostLoad({0}, read=lambda cpus: None).others_busy() == 0.0  # not Linux: unknown


def test_host_load_reads_every_cpu_where_affinity_is_unknown(monkeypatch):
    """Not Linux (no sched_getaffinity): HostLoad counts every CPU rather than failing, so
    a service still starts its recalibrator there."""
    monkeypatch.delattr("os.sched_getaffinity")
    assert HostLoad(read=lambda cpus: None).cpus == set(range(os.cpu_count() or 1))
