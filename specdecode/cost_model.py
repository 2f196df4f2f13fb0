"""What a forward pass costs on this hardware, measured rather than assumed (docs/design.md,
adaptive speculation).

A `ForwardCosts` table holds the seconds of one forward pass for a grid of batch rows ×
query tokens per row (the width), measured (specdecode.executor.calibration) through the
runner's public `forward(rows)` on a warm KV cache at every width the policy prices
(1 .. max k + 1: a forward's time need not grow with its width, fp32 on CPU measured
V(3) > V(8)), then refreshed from live forward timings (`observe`) and re-measured whole
when they drift (specdecode.serving.recalibration).
Widths are never interpolated where they were measured; between row counts the time is
linear, and beyond the last one it scales by rows. It answers every question the
speculation policy asks:

    decode                       costs(B, 1)
    verify k+1 tokens (multi-query)   costs(B, k+1)
    verify by batch expansion         costs(B·(k+1), k+1)   (each expanded row is padded
                                                             to k+1 new tokens)
    one draft step                    draft_costs(B, 1)
"""

from __future__ import annotations

import bisect
import statistics
import threading
from dataclasses import dataclass, field

LIVE_WEIGHT = 0.2  # weight of one live forward in a grid cell's running estimate
DRIFT = 1.3  # a live forward this far off its cell (either way) ...
DRIFT_RUN = 3  # ... this many times in a row: the table is stale, re-measure it


def drift(seconds: float, cell: float) -> int:
    """A timing against its table cell: -1 cheaper by DRIFT, 1 dearer by DRIFT, else 0 (the
    one rule live forwards, idle probes and a restart's check of a kept table share)."""
    return -1 if seconds * DRIFT < cell else 1 if seconds > DRIFT * cell else 0


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys); linear extrapolation from the end segments."""
    if len(xs) == 1:
        return ys[0]
    j = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class ForwardCosts:
    """Seconds of one forward pass: seconds[i][j] for rows[i] rows of tokens[j] query
    tokens each (both grids ascending). version counts re-measurements (0: start-up)."""

    rows: list[int]
    tokens: list[int]
    seconds: list[list[float]]  # [len(rows)][len(tokens)]
    version: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # Live evidence that the table is stale: consecutive drifting forwards, row counts seen
    # in traffic that the grid lacks.
    _drifting: int = field(default=0, repr=False, compare=False)
    _cheaper: int = field(default=0, repr=False, compare=False)  # of those, running cheaper
    # DRIFT_RUN ran cheaper in a row since the table was measured: kept until it is replaced
    # (the cell follows its live forwards, so the run itself ends within a few of them, and a
    # service whose traffic never paused for DRIFT_RUN forwards' worth never saw it)
    _ran_cheaper: bool = field(default=False, repr=False, compare=False)
    rows_seen: set[int] = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self):
        if not self.rows or not self.tokens:
            raise ValueError("ForwardCosts: empty grid")
        if len(self.seconds) != len(self.rows) or any(len(r) != len(self.tokens)
                                                       for r in self.seconds):
            raise ValueError(f"ForwardCosts: seconds must be {len(self.rows)}x{len(self.tokens)}")
        self._monotone()

    def _monotone(self) -> None:
        """More rows never cost less at the same width (timing noise on a busy host must
        not make a larger batch look cheaper). Across widths nothing is assumed: on CPU a
        wider forward can be faster than a narrower one (fp32: other kernels)."""
        for i in range(1, len(self.seconds)):
            self.seconds[i] = [max(s, below) for s, below in zip(self.seconds[i],
                                                                 self.seconds[i - 1])]

    def __call__(self, rows: int, tokens: int) -> float:
        """Predicted seconds of a forward of `rows` rows with `tokens` query tokens each."""
        if rows <= 0 or tokens <= 0:
            return 0.0
        if rows > self.rows[-1]:
            return self._beyond_rows(rows, tokens)
        by_rows = [_interp(self.tokens, r, tokens) for r in self.seconds]  # at each grid row count
        return max(_interp(self.rows, by_rows, rows), 1e-6)

    def _beyond_rows(self, rows: int, tokens: int) -> float:
        """More rows than the grid has: priced as the widest row count with as many tokens in
        all (a forward's matmuls cost by the tokens they multiply), linear in them past the
        widest cell. Per row at the last row count (the old rule) kept the 4-row table's
        flat widths: 10 streams' 2-token verify priced as a decode, measured 0.82x plain."""
        last, width = self.seconds[-1], tokens * rows / self.rows[-1]
        if width <= self.tokens[-1]:
            return max(_interp(self.tokens, last, width), 1e-6)
        return max(last[-1] * width / self.tokens[-1], 1e-6)

    @property
    def max_width(self) -> int:
        return self.tokens[-1]

    def observe(self, rows: int, tokens: int, seconds: float) -> bool:
        """Fold a live forward timing into its grid cell (exact grid points only); count
        it as drift when it is off the cell by DRIFT either way."""
        if tokens in self.tokens and rows not in self.rows:
            self.rows_seen.add(rows)
        try:
            i, j = self.rows.index(rows), self.tokens.index(tokens)
        except ValueError:
            return False
        with self._lock:
            cell = self.seconds[i][j]
            moved = drift(seconds, cell)
            cheaper, off = moved < 0, moved != 0
            self._drifting = self._drifting + 1 if off else 0
            self._cheaper = self._cheaper + 1 if cheaper else 0
            self._ran_cheaper = self._ran_cheaper or self._cheaper >= DRIFT_RUN
            self.seconds[i][j] += LIVE_WEIGHT * (seconds - cell)
            self._monotone()
        return True

    def stale(self) -> bool:
        """Live forwards drifted off the table (or ran cheaper since it was measured), or
        traffic runs row counts it lacks."""
        return self._drifting >= DRIFT_RUN or self.too_dear()

    def too_dear(self) -> bool:
        """Stale in the way that can lock speculation off: live forwards ran cheaper than
        their cells since it was measured (a table taken on a busy host), or traffic ran row
        counts it lacks."""
        return self._ran_cheaper or bool(self.rows_seen)

    def replace(self, measured: ForwardCosts | None) -> None:
        """Take a re-measured table's grid (a new version; None: keep this one, the
        re-measurement found it right); the live evidence restarts."""
        with self._lock:
            if measured is not None:
                self.rows, self.tokens = list(measured.rows), list(measured.tokens)
                self.seconds = [list(line) for line in measured.seconds]
                self.version += 1
            self._drifting = self._cheaper = 0
            self._ran_cheaper = False
            self.rows_seen = set()

    def ratio(self, other: ForwardCosts) -> float:
        """The median over this table's cells of other's time / this one's."""
        return statistics.median(other(r, t) / max(self(r, t), 1e-9)
                                 for r in self.rows for t in self.tokens)

    def snapshot(self) -> ForwardCosts:
        with self._lock:
            return ForwardCosts(list(self.rows), list(self.tokens),
                                [list(r) for r in self.seconds], self.version)


def verify_seconds(costs: ForwardCosts, method: str, lens: list[int]) -> float:
    """Predicted target forward for one scoring call: lens[i] proposal tokens of sequence i
    (0 = scored non-speculatively). multi-query: B rows, row i fed its own lens[i]+1 tokens
    (packed, not padded: the table at B rows and their mean width); batch-expansion:
    sum(lens[i]+1) rows padded to max(lens)+1 tokens (vLLM 0.4.2's expansion: each
    speculating sequence becomes n+1 rows, row j feeding the last accepted token and j
    proposals)."""
    if not lens:
        return 0.0
    width = max(lens) + 1
    if method == "multi-query":
        return costs(len(lens), 1 + sum(lens) / len(lens))
    if method == "batch-expansion":
        return costs(sum(n + 1 for n in lens), width)
    raise ValueError(f"scoring method: {method!r} is neither multi-query nor batch-expansion")


def cheaper_scoring(costs: ForwardCosts, lens: list[int]) -> str:
    """The scoring method with the smaller predicted forward (multi-query on a tie)."""
    mq, be = verify_seconds(costs, "multi-query", lens), verify_seconds(costs, "batch-expansion", lens)
    return "batch-expansion" if be < mq else "multi-query"
