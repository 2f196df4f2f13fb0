"""What a forward pass costs on this hardware, measured rather than assumed (docs/design.md,
adaptive speculation).

A `ForwardCosts` table holds the seconds of one forward pass for a grid of batch rows ×
query tokens per row, measured at start-up through the runner's public `forward(rows)` on
a warm KV cache, then refreshed from live forward timings (`observe`). Between grid points
it interpolates linearly; beyond the last row count it scales the time per row. It answers
every question the speculation policy asks:

    decode                       costs(B, 1)
    verify k+1 tokens (multi-query)   costs(B, k+1)
    verify by batch expansion         costs(B·(k+1), k+1)   (each expanded row is padded
                                                             to k+1 new tokens)
    one draft step                    draft_costs(B, 1)
"""

from __future__ import annotations

import bisect
import copy
import random
import threading
import time
from dataclasses import dataclass, field

from specdecode.model_runner import ForwardStats, ModelRunner, RunnerRow

CALIBRATION_ROWS = (1, 4)
CALIBRATION_TOKENS = (1, 2, 3, 5, 9)
CALIBRATION_CONTEXT = 32  # cached tokens per row while timing (a short, warm context)
LIVE_WEIGHT = 0.2  # weight of one live forward in a grid cell's running estimate


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
    tokens each (both grids ascending)."""

    rows: list[int]
    tokens: list[int]
    seconds: list[list[float]]  # [len(rows)][len(tokens)]
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self):
        if not self.rows or not self.tokens:
            raise ValueError("ForwardCosts: empty grid")
        if len(self.seconds) != len(self.rows) or any(len(r) != len(self.tokens)
                                                       for r in self.seconds):
            raise ValueError(f"ForwardCosts: seconds must be {len(self.rows)}x{len(self.tokens)}")
        self._monotone()

    def _monotone(self) -> None:
        """More rows or more tokens never cost less: timing noise on a busy host must not
        make the policy believe that a longer verify is cheaper than a shorter one."""
        for i, line in enumerate(self.seconds):
            for j in range(len(line)):
                below = [line[j - 1]] if j else []
                if i:
                    below.append(self.seconds[i - 1][j])
                line[j] = max([line[j], *below])

    def __call__(self, rows: int, tokens: int) -> float:
        """Predicted seconds of a forward of `rows` rows with `tokens` query tokens each."""
        if rows <= 0 or tokens <= 0:
            return 0.0
        by_rows = [_interp(self.tokens, r, tokens) for r in self.seconds]  # at each grid row count
        if rows > self.rows[-1]:  # beyond the grid: the last measured time per row
            return max(by_rows[-1] * rows / self.rows[-1], 0.0)
        return max(_interp(self.rows, by_rows, rows), 1e-6)

    def observe(self, rows: int, tokens: int, seconds: float) -> bool:
        """Fold a live forward timing into its grid cell (exact grid points only)."""
        try:
            i, j = self.rows.index(rows), self.tokens.index(tokens)
        except ValueError:
            return False
        with self._lock:
            self.seconds[i][j] += LIVE_WEIGHT * (seconds - self.seconds[i][j])
            self._monotone()
        return True

    def observe_forward(self, f: ForwardStats) -> None:
        """A ModelRunner.on_forward hook: decode, draft and multi-query forwards on a warm
        cache feed the same number of tokens to every row, so their shape is known."""
        if f.cache_misses == 0 and f.batch_size and f.tokens_computed % f.batch_size == 0:
            self.observe(f.batch_size, f.tokens_computed // f.batch_size, f.seconds)

    def snapshot(self) -> ForwardCosts:
        with self._lock:
            return ForwardCosts(list(self.rows), list(self.tokens), [list(r) for r in self.seconds])


def calibrate(runner: ModelRunner, rows: tuple[int, ...] = CALIBRATION_ROWS,
              tokens: tuple[int, ...] = CALIBRATION_TOKENS, repeats: int = 2,
              context: int = CALIBRATION_CONTEXT) -> ForwardCosts:
    """Time runner.forward for every (rows, tokens) cell on a warm cache of `context`
    tokens per row; the fastest of `repeats` after one untimed warm-up (other processes
    only ever add time). Uses cache ids below zero (never a real sequence's) and releases
    them."""
    rng = random.Random(0)
    vocab = runner.vocab_size
    context = max(1, min(context, runner.max_model_len - max(tokens) - 1))
    ids = [-1 - i for i in range(max(rows))]
    prefixes = [[rng.randrange(vocab) for _ in range(context)] for _ in ids]
    # Calibration is not traffic: the runner's counters and forward hook do not see it.
    hook, runner.on_forward, counters = runner.on_forward, None, copy.copy(runner.stats)
    try:
        runner.forward([RunnerRow(c, p, 1) for c, p in zip(ids, prefixes)])  # fill the cache
        table = []
        for r in rows:
            line = []
            for q in tokens:
                batch = [RunnerRow(c, p + [rng.randrange(vocab) for _ in range(q)], q)
                         for c, p in zip(ids[:r], prefixes[:r])]
                runner.forward(batch)  # warm-up (allocations, kernel selection)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    runner.forward(batch)
                    times.append(time.perf_counter() - start)
                line.append(min(times))
            table.append(line)
    finally:
        runner.on_forward, runner.stats = hook, counters
        runner.release(ids)
    return ForwardCosts(list(rows), list(tokens), table)


def attach_live_costs(runner: ModelRunner, costs: ForwardCosts) -> None:
    """Refresh `costs` from every later forward of `runner`, after any hook already set."""
    previous = runner.on_forward

    def hook(f: ForwardStats) -> None:
        if previous is not None:
            previous(f)
        costs.observe_forward(f)
    runner.on_forward = hook


def verify_seconds(costs: ForwardCosts, method: str, lens: list[int]) -> float:
    """Predicted target forward for one scoring call: lens[i] proposal tokens of sequence i
    (0 = scored non-speculatively). Rows are padded to the longest row's new tokens.
    multi-query: B rows of max(lens)+1 tokens; batch-expansion: sum(lens[i]+1) rows of
    max(lens)+1 tokens (vLLM 0.4.2's expansion: each speculating sequence becomes n+1 rows,
    row j feeding the last accepted token and j proposals)."""
    if not lens:
        return 0.0
    width = max(lens) + 1
    if method == "multi-query":
        return costs(len(lens), width)
    if method == "batch-expansion":
        return costs(sum(n + 1 for n in lens), width)
    raise ValueError(f"scoring method: {method!r} is neither multi-query nor batch-expansion")


def cheaper_scoring(costs: ForwardCosts, lens: list[int]) -> str:
    """The scoring method with the smaller predicted forward (multi-query on a tie)."""
    mq, be = verify_seconds(costs, "multi-query", lens), verify_seconds(costs, "batch-expansion", lens)
    return "batch-expansion" if be < mq else "multi-query"
