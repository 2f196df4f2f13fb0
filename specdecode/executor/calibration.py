"""Measuring what a forward pass costs on this runner (docs/design.md, adaptive speculation):
the `ForwardCosts` table (specdecode.cost_model) timed cell by cell through the runner's
public `forward(rows)` on a warm KV cache at start-up (`calibrate`), and kept fresh from
every later forward (`attach_live_costs`). Re-measured whole when it drifts
(specdecode.serving.recalibration, one `Calibration` cell at a time while the service idles).
"""

from __future__ import annotations

import copy
import random
import time

from specdecode.cost_model import ForwardCosts
from specdecode.executor.model_runner import ForwardStats, ModelRunner, RunnerRow

CALIBRATION_ROWS = (1, 4)
CALIBRATION_WIDTH = 9  # widest verify timed at start-up: the default max k (8) + 1
CALIBRATION_CONTEXT = 32  # cached tokens per row while timing (a short, warm context)
CELL_MIN_S, MAX_REPEATS = 0.05, 16  # a cell is timed until this long, at most this often


def calibration_widths(max_width: int, catch_up: bool = False) -> tuple[int, ...]:
    """Every width 1..max_width; a draft also prices its catch-up (a forward reading every
    token it missed), so its table adds 2x, 4x and 8x the widest."""
    widths = tuple(range(1, max(max_width, 1) + 1))
    return widths + tuple(m * max_width for m in (2, 4, 8)) if catch_up else widths


class Calibration:
    """Times runner.forward one cell (rows x query tokens) at a time on a warm cache of
    `context` tokens per row: the fastest of at least `repeats` after one untimed warm-up
    (other processes only ever add time), repeated until the fastest times the count reaches
    CELL_MIN_S (at most MAX_REPEATS times): a millisecond forward preempted by another
    process's time slice measured 20-70x its time, and the fastest of two is not robust to
    that on a busy host (counting the time spent instead, one preempted sample of a 4 ms
    draft forward ended its cell at 117 ms). Uses cache ids below zero (never a real sequence's);
    calibration is not traffic: the runner's counters and forward hook do not see it.
    close() releases the ids."""

    def __init__(self, runner: ModelRunner, max_rows: int, max_tokens: int,
                 context: int = CALIBRATION_CONTEXT, repeats: int = 2):
        self.runner, self.repeats = runner, repeats
        self.rng = random.Random(0)
        context = max(1, min(context, runner.max_model_len - max_tokens - 1))
        self.ids = [-1 - i for i in range(max_rows)]
        self.prefixes = [[self.rng.randrange(runner.vocab_size) for _ in range(context)]
                         for _ in self.ids]

    def cell(self, rows: int, tokens: int, repeats: int | None = None, warm: bool = True) -> float:
        """Seconds of one forward of `rows` rows with `tokens` new tokens each (the fastest
        of `repeats`, self.repeats by default, after an untimed warm-up unless `warm` is
        False: the cell was timed before)."""
        runner = self.runner
        hook, runner.on_forward, counters = runner.on_forward, None, copy.copy(runner.stats)
        repeats = self.repeats if repeats is None else repeats
        try:
            batch = [RunnerRow(c, p + [self.rng.randrange(runner.vocab_size) for _ in range(tokens)],
                               tokens) for c, p in zip(self.ids[:rows], self.prefixes[:rows])]
            if warm:  # fills the cache, allocations, kernel selection
                runner.forward(batch)
            times: list[float] = []
            while len(times) < repeats or (min(times) * len(times) < CELL_MIN_S
                                           and len(times) < MAX_REPEATS):
                start = time.perf_counter()
                runner.forward(batch)
                times.append(time.perf_counter() - start)
            return min(times)
        finally:
            runner.on_forward, runner.stats = hook, counters

    def warm_up(self, rows: int, tokens: int) -> None:
        """A process's first forwards pay for thread pools, allocations and kernel choices
        (a tiny model's first decode cell read 270 ms against 0.5 ms): time the smallest
        cell twice and the largest once, untimed, before the table is timed."""
        saved, self.repeats = self.repeats, 1
        try:
            for r, q in ((1, 1), (1, 1), (rows, tokens)):
                self.cell(r, q)
        finally:
            self.repeats = saved

    def close(self) -> None:
        self.runner.release(self.ids)


def calibrate(runner: ModelRunner, rows: tuple[int, ...] = CALIBRATION_ROWS,
              tokens: tuple[int, ...] = calibration_widths(CALIBRATION_WIDTH), repeats: int = 2,
              context: int = CALIBRATION_CONTEXT) -> ForwardCosts:
    """Time runner.forward for every (rows, tokens) cell (Calibration), in two passes over
    the grid, each cell its fastest: a stall of the host (another process's burst) then
    costs one sample of several cells, not every sample of one (timed one cell at a time
    on a loaded host, a tiny model's 5-token verify read 3.2 s beside 1.1 s at 4 tokens)."""
    session = Calibration(runner, max(rows), max(tokens), context, repeats)
    try:
        session.warm_up(max(rows), max(tokens))
        table = [[session.cell(r, q) for q in tokens] for r in rows]
        table = [[min(s, session.cell(r, q, repeats=1, warm=False)) for q, s in zip(tokens, line)]
                 for r, line in zip(rows, table)]
    finally:
        session.close()
    return ForwardCosts(list(rows), list(tokens), table)


def attach_live_costs(runner: ModelRunner, costs: ForwardCosts) -> None:
    """Refresh `costs` from every later forward of `runner`, after any hook already set."""
    previous = runner.on_forward

    def hook(f: ForwardStats) -> None:
        if previous is not None:
            previous(f)
        # Decode, draft and multi-query forwards on a warm cache feed the same number of
        # tokens to every row, so their shape is known.
        if f.cache_misses == 0 and f.batch_size and f.tokens_computed % f.batch_size == 0:
            costs.observe(f.batch_size, f.tokens_computed // f.batch_size, f.seconds)
    runner.on_forward = hook
