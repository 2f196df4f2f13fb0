"""Back-pressure: the outputs of one generation that its client has not taken yet, bounded.

The engine thread `put`s each output it hands to the generation's queue; the API side
`take`s each one it reads from there, which it does only when its client's transport has
taken the previous one (a gRPC write completes within the HTTP/2 flow-control window, an
HTTP chunk once the socket's write buffer drains). While `capacity` outputs wait, the
generation's sequences are paused: the scheduler leaves them out (their KV state stays on
the services) instead of generating into memory, and the first `take` wakes the engine
loop again. `stalled_for` is how long outputs have waited with nothing taken: the stream
write timeout (orchestrator.frontend.stream_watch) cancels a client stalled that long.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# Outputs (one per step that emitted tokens) a sample's client may have waiting before its
# sequence is paused: a few steps of slack, so a reader that keeps up is never paused.
OUTPUTS_PER_SAMPLE = 16


class Outbox:
    def __init__(self, capacity: int, wake: Callable[[], None] = lambda: None):
        """capacity: outputs waiting at most before the sequences pause; wake: called (on
        the taking thread) when a take un-pauses them."""
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.capacity = capacity
        self._wake = wake
        self._lock = threading.Lock()
        self._waiting = 0
        self._since: float | None = None  # outputs waiting, none taken since (monotonic)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def full(self) -> bool:
        """Whether the generation's sequences are paused (any thread)."""
        return self._waiting >= self.capacity

    def put(self) -> None:
        """One more output handed to the client's queue (the engine thread)."""
        with self._lock:
            self._waiting += 1
            if self._since is None:
                self._since = time.monotonic()

    def take(self) -> None:
        """One output read by the API side; wakes the engine when that un-pauses."""
        with self._lock:
            was_full = self._waiting >= self.capacity
            self._waiting = max(0, self._waiting - 1)
            self._since = time.monotonic() if self._waiting else None
        if was_full:
            self._wake()

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds outputs have waited with none taken (0 when none waits)."""
        since = self._since
        return 0.0 if since is None else (time.monotonic() if now is None else now) - since
