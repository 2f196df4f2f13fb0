"""Acceptance metrics, as vLLM 0.4.2's `spec_decode/metrics.py` defines them.

`AcceptanceTotals` sums the engine's step stats (orchestrator.engine.core.StepStats, the one place
acceptance is counted); `AsyncMetricsCollector` turns them into vLLM 0.4.2's
`SpecDecodeWorkerMetrics` with vLLM's two-call protocol: a call that finds the interval passed
takes a snapshot and returns None, the next call returns the metrics of that snapshot. vLLM
copies device counters to the host there; here the counts already live on the host (the
rejection sampler keeps none), so the snapshot is a plain copy that never waits on a device.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from orchestrator.engine.step_stats import StepStats

Timer = Callable[[], float]


@dataclass
class AcceptanceTotals:
    """Acceptance counts since start, summed from step stats (host-side ints)."""

    accepted_tokens: int = 0  # passed the accept test (vLLM 0.4.2's meaning)
    emitted_tokens: int = 0  # emitted by speculative steps
    draft_tokens: int = 0
    spec_sequences: int = 0  # sequence-steps that speculated
    max_emitted_tokens: int = 0  # sum over steps of spec_sequences x (k+1)

    def add(self, step: StepStats) -> None:
        self.accepted_tokens += step.accepted_tokens
        self.emitted_tokens += step.emitted_tokens
        self.draft_tokens += step.draft_tokens
        self.spec_sequences += step.spec_sequences
        self.max_emitted_tokens += step.spec_sequences * (step.k + 1)

    @property
    def draft_acceptance_rate(self) -> float:
        """accepted / draft; NaN before any draft token."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else math.nan

    @property
    def system_efficiency(self) -> float:
        """emitted / (speculating sequence-steps x (k+1)), with each step's own k; NaN before any."""
        return (self.emitted_tokens / self.max_emitted_tokens if self.max_emitted_tokens
                else math.nan)


@dataclass
class SpecDecodeWorkerMetrics:
    """Metrics of speculative decoding, cumulative since start."""

    # The empirical acceptance rate of the proposal method on a per-token basis.
    # This is useful for evaluating how well the proposal method aligns with the
    # scoring method.
    draft_acceptance_rate: float

    # The empirical efficiency, measured as the number of tokens emitted by the
    # system divided by the number of tokens that could be emitted by the system
    # if the proposal method were perfect.
    system_efficiency: float

    # The number of speculative tokens produced by the proposal method.
    draft_tokens: int

    # The number of tokens emitted by the entire system.
    emitted_tokens: int

    # The number of tokens accepted by the scoring model and verification
    # routine, e.g. Llama2-70B and lossless rejection sampling.
    #
    # NOTE: Any token accepted by the verification routine is considered
    # accepted (regardless of if the speculative prefix is also accepted). The
    # user will usually see less accepted tokens. This metric is helpful when
    # evaluating alignment of the proposal method with the scoring model.
    accepted_tokens: int

    # The number of speculative tokens per sequence.
    num_spec_tokens: int


class AsyncMetricsCollector:
    """vLLM 0.4.2's collector over the engine's acceptance totals."""

    def __init__(self, totals: AcceptanceTotals, timer: Timer | None = None,
                 collect_interval_s: float = 5.0, restart_interval: bool = False):
        self._totals = totals
        self._timer = time.time if timer is None else timer
        self._rank: int | None = None  # None until init_tensors: never collects
        self._snapshot: AcceptanceTotals | None = None  # taken, not yet returned
        self._rejsample_metrics_collect_interval_s = collect_interval_s
        # As in vLLM 0.4.2, set once here and never reset: once the interval has passed, every
        # other call collects (one takes a snapshot, the next returns it). restart_interval=True
        # (for periodic logging) restarts the interval at each snapshot instead.
        self._last_metrics_collect_time = self._timer()
        self._restart_interval = restart_interval

    def init_tensors(self, rank: int) -> None:
        """Set the rank: only rank 0 collects (vLLM 0.4.2's name; there are no tensors to
        allocate, the totals live on the host)."""
        self._rank = rank

    def maybe_collect_rejsample_metrics(self, k: int) -> SpecDecodeWorkerMetrics | None:
        """Metrics if a snapshot was taken by the previous call; else maybe take one and
        return None."""
        if self._snapshot is not None:
            snapshot, self._snapshot = self._snapshot, None
            return self._collect_rejsample_metrics(k, snapshot)
        now = self._timer()
        if self._should_collect_rejsample_metrics(now):
            self._snapshot = dataclasses.replace(self._totals)
            if self._restart_interval:
                self._last_metrics_collect_time = now
        return None

    def _should_collect_rejsample_metrics(self, now: float) -> bool:
        if self._rank != 0:
            return False
        return now - self._last_metrics_collect_time >= self._rejsample_metrics_collect_interval_s

    @staticmethod
    def _collect_rejsample_metrics(k: int, snapshot: AcceptanceTotals) -> SpecDecodeWorkerMetrics:
        """The metrics of a snapshot; k is the speculation length."""
        accepted_tokens = snapshot.accepted_tokens
        emitted_tokens = snapshot.emitted_tokens
        draft_tokens = snapshot.draft_tokens
        # Counted per step rather than derived as draft_tokens // k (vLLM 0.4.2's
        # get_max_num_emitted_tokens): equal when every sequence proposes k tokens, and still
        # right when proposal lengths are ragged.
        max_num_emitted_tokens = snapshot.spec_sequences * (k + 1)
        draft_acceptance_rate = (accepted_tokens / draft_tokens if draft_tokens > 0
                                 else float("nan"))
        system_efficiency = (emitted_tokens / max_num_emitted_tokens
                             if max_num_emitted_tokens > 0 else float("nan"))
        return SpecDecodeWorkerMetrics(
            num_spec_tokens=k,
            draft_acceptance_rate=draft_acceptance_rate,
            system_efficiency=system_efficiency,
            accepted_tokens=accepted_tokens,
            draft_tokens=draft_tokens,
            emitted_tokens=emitted_tokens,
        )

    @staticmethod
    def get_max_num_emitted_tokens(draft_tokens: int, k: int) -> int:
        """Emitted tokens if every proposal were accepted: (draft_tokens // k) sequences × (k+1).

        Valid only when every sequence proposed exactly k tokens (vLLM 0.4.2's assumption), so
        draft_tokens must be a multiple of k; raises ValueError otherwise.
        """
        if k < 1 or draft_tokens % k != 0:
            raise ValueError(f"draft_tokens ({draft_tokens}) must be a multiple of k ({k}), k >= 1")
        return draft_tokens // k * (k + 1)
