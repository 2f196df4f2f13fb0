"""Keeping a service's forward-cost table true to its host (docs/design.md, adaptive
speculation: calibrate what you price).

A table timed at start-up on a busy host (another process on the cores, the other service
loading) can be several times off, and live forwards refresh only the cells that traffic
runs: with the policy decoding plainly, only the decode cells, so the verify cells stay as
dear as the busy start-up measured them and speculation never looks worth trying. So the
service re-measures the whole table, cell by cell, while it is idle (no call for IDLE_S)
and so is its host (specdecode.serving.host_load: no other process kept its CPUs busy; an idle
proposer that timed forwards beside the scorer's plain decodes slowed them and published
a table ~1.8x too dear), when

- live forwards drifted off their cells (ForwardCosts.stale: DRIFT either way, DRIFT_RUN
  in a row), or traffic ran row counts the grid lacks (they are added, MAX_ROWS at most);
- or, with no traffic at all, a probe (a decode and a one-row forward at the widest width,
  every PROBE_S while idle) is off the table's by DRIFT twice in a row.

Where the host's load lasts (LASTING_S), tables are probed under it too, and only one that
reads too dear (live forwards or probes ran cheaper, or new row counts) is re-measured under
it: that one locks speculation off; one that reads dearer waits for a quiet host.

A call arriving meanwhile stops the cell being timed at its next module (the service's own
work yields to traffic, specdecode.serving.model_access), and the re-measurement with it; it starts
again at the next idle spell. The new table replaces the old (a new version, which the
orchestrator adopts) when its cells moved by DRIFT (median over cells) from the last table
measured whole (the start-up one, then each new version), and probes are held against that
one too: live forwards run beside the other service's and read dearer than idle ones, and
held against the live cells every idle spell published the idle table again (x0.62, a new
version every 20 s in CI), each adoption wiping what the orchestrator's policy had learned.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from specdecode.cost_model import DRIFT, ForwardCosts, drift
from specdecode.executor.calibration import Calibration
from specdecode.serving.host_load import HostLoad
from specdecode.serving.model_access import ForwardStopped, ModelAccess
from specdecode.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)

IDLE_S = 2.0  # no call for this long: the service is idle
PROBE_S = 10.0  # while idle, a probe this often
MAX_ROWS = 8  # row counts in a table at most (merged_rows)
PROBE_CONTEXT = 8  # cached tokens of a probe's row (it refills them each time)
BACKOFF_S = 10.0  # the host found busy: nothing is timed for a random half to whole of this
# ... unless live forwards say the table is stale and the load held it back this long (busy
# at every check or now and then): a load that lasts is the host's condition (probes still
# wait for an idle host)
LASTING_S = 10.0


def merged_rows(table: list[int], seen: set[int]) -> list[int]:
    """The table's row counts with those traffic ran, at most MAX_ROWS: 1 and the largest
    always, then the table's own, then the seen ones, smallest first."""
    want = sorted(set(table) | seen)
    keep = {1, want[-1]} | set(table)
    for r in want:
        if len(keep) >= MAX_ROWS:
            break
        keep.add(r)
    return sorted(keep)[:MAX_ROWS]


class Recalibrator:
    """Re-measures `costs` in the background (run() is the task); the runner's forwards go
    through `model`, one at a time with the service's calls."""

    def __init__(self, runner: ModelRunner, costs: ForwardCosts, model: ModelAccess,
                 idle_s: float = IDLE_S, probe_s: float = PROBE_S, host: HostLoad | None = None,
                 backoff_s: float = BACKOFF_S, lasting_s: float = LASTING_S,
                 on_replace: Callable[[ForwardCosts], None] | None = None):
        """on_replace: called with each new table (specdecode.executor.cost_cache keeps it)."""
        self.runner, self.costs, self.model = runner, costs, model
        self.on_replace = on_replace
        self.host, self.backoff_s, self.lasting_s = host or HostLoad(), backoff_s, lasting_s
        self.held_until = 0.0  # the host was busy: nothing is timed before this ...
        self.held_since: float | None = None  # ... and the idle service held back since
        self.measured = costs.snapshot()  # the last table measured whole (not the live cells)
        self.idle_s, self.probe_s = idle_s, probe_s
        self.off = self.cheaper = 0  # consecutive probes off the table, of them cheaper
        self.next_probe = time.monotonic() + probe_s

    def start(self) -> None:
        """Run in the background on the running event loop (until it stops)."""
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.idle_s / 2)
            try:
                await self.step()
            except Exception:  # a failed measurement must not end the service
                log.exception("re-measuring the forward costs failed")

    async def step(self) -> bool:
        """One check: re-measure if the table is stale; True when it was replaced."""
        idle = self._idle()
        if idle is None:
            return False
        try:
            if self.costs.stale():
                dear = self.costs.too_dear()
            elif time.monotonic() < self.next_probe:
                return False
            else:
                off = await self._probe()
                if off is None:
                    return False
                dear = off == "cheaper"
            if idle == "lasting" and not dear:
                return False
            return await self.remeasure(lasting=dear)
        except ForwardStopped:  # a call came during a cell: it went first
            return False

    def _idle(self) -> str | None:
        """"quiet": no call for idle_s, no other process kept the host's CPUs busy since
        the last check (the other service's traffic on a shared host, another tenant), and
        none did within a random back-off before: two idle services on one host that both
        start to time see each other as load and both stop; held for different times, one
        goes first and the other finds it busy, until it is done. "lasting": no call for
        idle_s, but the host's load held the service back for lasting_s, busy at every
        check or now and then (the load is the host's condition): only a table that reads
        too dear is timed under it, since that one locks speculation off (ForwardCosts.
        too_dear, or probes that ran cheaper). Under busy loops that stay, a table missing
        the row counts traffic ran was never re-measured, beside work that came and went
        neither (each busy check renewed the back-off; CI's proposer, stale after traffic
        of 2 and 3 rows, waited 50 s), and a start-up table timed under heavier load was
        never probed: its verify cells stayed 6-12x its decode (the policy's
        verify_too_dear) for as long as two busy loops ran beside the stack. A table whose
        forwards read dearer waits for a quiet host: timed beside the other service's plain
        decodes, a proposer slowed them for 45 s and published a table x1.98 dearer, and
        the policy decoded plainly meanwhile (adaptive_bench, Q&A: 0.78x own k=0).
        None: not idle."""
        if self.model.idle_for() < self.idle_s:
            self.held_since = None
            return None
        now = time.monotonic()
        if self.host.busy():
            self.held_until = now + random.uniform(0.5, 1.0) * self.backoff_s
        elif now >= self.held_until:
            self.held_since = None
            return "quiet"
        self.held_since = now if self.held_since is None else self.held_since
        return "lasting" if now - self.held_since >= self.lasting_s else None

    async def _probe(self) -> str | None:
        """A probe: a decode and a one-row forward at the table's widest width. Returns
        "cheaper" when two probes in a row read either cheaper than the table by DRIFT,
        "off" when two in a row had either off it either way (the second follows the first
        at once), else None. The wide cell too: a host's load can inflate a wide forward
        many times more than a decode (two threads stalled on a busy core), and a probe of
        the decode alone then found the table right while every verify it priced read 3x
        too dear."""
        widest = self.measured.max_width
        probe = Calibration(self.runner, 1, widest, context=PROBE_CONTEXT)
        try:
            off = cheaper = False
            for width in sorted({1, widest}):
                seconds = await self.model.run(probe.cell, 1, width, traffic=False)
                table = self.measured(1, width)
                moved = drift(seconds, table)
                cheaper, off = cheaper or moved < 0, off or moved != 0
        finally:
            probe.close()  # nothing of it stays in the cache
        self.off = self.off + 1 if off else 0
        self.cheaper = self.cheaper + 1 if cheaper else 0
        self.next_probe = time.monotonic() + (0.0 if self.off == 1 else self.probe_s)
        return "cheaper" if self.cheaper >= 2 else "off" if self.off >= 2 else None

    async def remeasure(self, lasting: bool = False) -> bool:
        """Every cell of the table (and the row counts traffic added), while quiet (or, for
        a table too dear, `lasting`, also under a load that lasts: `_idle`); False
        when a call came between two cells or nothing moved, ForwardStopped when one came
        during a cell (either way it is tried again at the next idle spell)."""
        rows = merged_rows(self.costs.rows, self.costs.rows_seen)
        widths = list(self.costs.tokens)
        session = Calibration(self.runner, max(rows), max(widths))
        try:
            table = []
            for r in rows:
                line = []
                for w in widths:
                    idle = self._idle()
                    if idle is None or idle == "lasting" and not lasting:
                        return False
                    line.append(await self.model.run(session.cell, r, w, traffic=False))
                table.append(line)
        finally:
            session.close()
        measured = ForwardCosts(rows, widths, table)
        self.off = self.cheaper = 0
        self.next_probe, self.held_since = time.monotonic() + self.probe_s, None
        moved = self.measured.ratio(measured)
        if rows == self.measured.rows and 1 / DRIFT <= moved <= DRIFT:
            self.costs.replace(None)  # the table was right: no new version
            return False
        self.costs.replace(measured)
        self.measured = measured
        if self.on_replace is not None:
            self.on_replace(measured)
        log.info("forward costs re-measured while idle (x%.2f the old table's, rows %s): "
                 "version %d", moved, rows, self.costs.version)
        return True
