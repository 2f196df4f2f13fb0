"""How many requests may be in the orchestrator at once (docs/security.md; invariant 7).

`Admission.admit()`: a slot among `max_running + max_queued` requests, or `Overloaded` with a
retry hint (RESOURCE_EXHAUSTED / HTTP 429); the engine loop runs at most `max_running` of
them at once and the rest wait at the step boundary. What one request may ask for is
orchestrator.frontend.request; the per-step token budget (chunked prefill) lives in the
engine: `max_num_batched_tokens`.
"""

from __future__ import annotations

import threading
import time

from specdecode.errors import Overloaded


class Admission:
    """Counts requests inside the orchestrator (running or waiting). Thread-safe."""

    def __init__(self, max_running: int, max_queued: int):
        self.max_running, self.max_queued = max_running, max_queued
        self._lock = threading.Lock()
        self._inside = 0
        self._seconds = 1.0  # moving average of a request's time inside, for retry hints

    @property
    def inside(self) -> int:
        return self._inside

    def admit(self) -> Slot:
        with self._lock:
            if self._inside >= self.max_running + self.max_queued:
                waves = 1 + (self._inside - self.max_running) / max(1, self.max_running)
                retry = round(min(60.0, max(1.0, self._seconds * waves)), 1)
                raise Overloaded(f"server busy: {self.max_running} requests running "
                                 f"(--max-running-requests) and {self.max_queued} waiting "
                                 f"(--max-queued-requests); retry in {retry} s", retry)
            self._inside += 1
        return Slot(self)

    def _leave(self, seconds: float) -> None:
        with self._lock:
            self._inside -= 1
            self._seconds = 0.9 * self._seconds + 0.1 * seconds


class Slot:
    """One admitted request; `release` once when it ends (also as a context manager)."""

    def __init__(self, admission: Admission):
        self._admission, self._start, self._open = admission, time.monotonic(), True

    def release(self) -> None:
        if self._open:
            self._open = False
            self._admission._leave(time.monotonic() - self._start)

    def __del__(self) -> None:  # a response dropped before it ran (a client gone early)
        self.release()

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
