"""Acceptance metrics, as vLLM 0.4.2's `spec_decode/metrics.py` defines them.

`AsyncMetricsCollector` copies the rejection sampler's device counters to the host without
stalling a step: a call that finds the interval passed starts the copy and returns None, the next
call waits for it and returns the metrics. On an accelerator (cuda, npu) the copy runs on the
device's own stream and is marked by an event of that backend; on CPU it is a plain copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

Timer = Callable[[], float]


class SamplerCounters(Protocol):
    """What the collector reads from the sampler (orchestrator.rejection_sampler.RejectionSampler)."""

    num_accepted_tokens: torch.Tensor  # long scalar, on the sampler's device
    num_emitted_tokens: torch.Tensor  # long scalar, on the sampler's device
    num_draft_tokens: int
    num_spec_sequences: int


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


class _Done:
    """The marker of a copy that already finished (the CPU path)."""

    def synchronize(self) -> None:
        pass


class AsyncMetricsCollector:
    """Copies the rejection sampler's counters to the host and turns them into metrics."""

    def __init__(self, rejection_sampler: SamplerCounters, timer: Timer | None = None,
                 collect_interval_s: float = 5.0, restart_interval: bool = False):
        self._rejection_sampler = rejection_sampler
        self._timer = time.time if timer is None else timer
        self._rank: int | None = None  # None until init_tensors: never collects
        self._backend: Any = None  # torch.cuda / torch.npu; None on CPU
        self._copy_stream: Any = None
        self._in_flight_copy: Any = None  # an event (or _Done) while a copy is pending
        self._aggregate_num_accepted_tokens = torch.zeros((), dtype=torch.long)
        self._aggregate_num_emitted_tokens = torch.zeros((), dtype=torch.long)
        self._aggregate_num_draft_tokens = 0
        self._aggregate_num_spec_sequences = 0
        self._rejsample_metrics_collect_interval_s = collect_interval_s
        # As in the seed, set once here and never reset: once the interval has passed, every
        # other call collects (one starts a copy, the next returns it). restart_interval=True
        # (for periodic logging) restarts the interval at each copy instead.
        self._last_metrics_collect_time = self._timer()
        self._restart_interval = restart_interval

    def init_tensors(self, rank: int, device: torch.device | str) -> None:
        """Set the rank (only rank 0 collects) and the device the sampler's counters live on.

        Raises RuntimeError if `device` is an accelerator whose torch backend is not there.
        """
        # The type is read from the string first: torch.device("npu") itself fails unless
        # torch_npu has registered the backend.
        kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
        self._rank = rank
        if kind == "cpu":
            self._backend = self._copy_stream = None
            return
        backend = getattr(torch, kind, None)
        if backend is None or not hasattr(backend, "Stream") or not backend.is_available():
            hint = " (install torch_npu: the [npu] extra, with Ascend CANN)" if kind == "npu" else ""
            raise RuntimeError(
                f"metrics collector: device {str(device)!r} needs the torch.{kind} backend, "
                f"which is not available here{hint}")
        self._backend = backend
        self._copy_stream = backend.Stream(device=torch.device(device))
        # Pinned host memory makes the device->host copy truly asynchronous.
        self._aggregate_num_accepted_tokens = torch.zeros((), dtype=torch.long, pin_memory=True)
        self._aggregate_num_emitted_tokens = torch.zeros((), dtype=torch.long, pin_memory=True)

    def maybe_collect_rejsample_metrics(self, k: int) -> SpecDecodeWorkerMetrics | None:
        """Metrics if a copy was started by the previous call; else maybe start one and return None."""
        if self._in_flight_copy is not None:
            ready_event, self._in_flight_copy = self._in_flight_copy, None
            return self._collect_rejsample_metrics(k, ready_event)
        now = self._timer()
        if self._should_collect_rejsample_metrics(now):
            self._in_flight_copy = self._copy_rejsample_metrics_async()
            if self._restart_interval:
                self._last_metrics_collect_time = now
        return None

    def _should_collect_rejsample_metrics(self, now: float) -> bool:
        if self._rank != 0:
            return False
        return now - self._last_metrics_collect_time >= self._rejsample_metrics_collect_interval_s

    def _copy_rejsample_metrics_async(self) -> Any:
        """Start copying the counters to the host; return an event marking the copy's end."""
        sampler = self._rejection_sampler
        # Host-side counts need no copy.
        self._aggregate_num_draft_tokens = sampler.num_draft_tokens
        self._aggregate_num_spec_sequences = sampler.num_spec_sequences
        if self._backend is None:
            self._aggregate_num_accepted_tokens.copy_(sampler.num_accepted_tokens)
            self._aggregate_num_emitted_tokens.copy_(sampler.num_emitted_tokens)
            return _Done()
        backend = self._backend
        self._copy_stream.wait_stream(backend.current_stream())
        with backend.stream(self._copy_stream):
            self._aggregate_num_accepted_tokens.copy_(sampler.num_accepted_tokens,
                                                      non_blocking=True)
            self._aggregate_num_emitted_tokens.copy_(sampler.num_emitted_tokens,
                                                     non_blocking=True)
        ready = backend.Event()
        ready.record(self._copy_stream)
        return ready

    def _collect_rejsample_metrics(self, k: int, ready_event: Any) -> SpecDecodeWorkerMetrics:
        """Wait for the copy and compute the metrics; k is the speculation length."""
        ready_event.synchronize()
        accepted_tokens = int(self._aggregate_num_accepted_tokens.item())
        emitted_tokens = int(self._aggregate_num_emitted_tokens.item())
        draft_tokens = self._aggregate_num_draft_tokens
        # Counted by the sampler rather than derived as draft_tokens // k (the seed's
        # get_max_num_emitted_tokens): equal when every sequence proposes k tokens, and still
        # right when proposal lengths are ragged.
        max_num_emitted_tokens = self._aggregate_num_spec_sequences * (k + 1)
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

        Valid only when every sequence proposed exactly k tokens (the seed's assumption), so
        draft_tokens must be a multiple of k; raises ValueError otherwise.
        """
        if k < 1 or draft_tokens % k != 0:
            raise ValueError(f"draft_tokens ({draft_tokens}) must be a multiple of k ({k}), k >= 1")
        return draft_tokens // k * (k + 1)
