"""Leases on a service's per-sequence state (its delta token store and KV cache entries).

The orchestrator releases a sequence when it finishes; a release that never arrives (a link
that went silent, an orchestrator that crashed) would otherwise hold that state until the
store's or the pool's LRU bound pushes it out. Every call that names a sequence renews its
lease; the service reclaims the state of sequences whose lease ran out (ModelServicer).
Reclaiming is always safe: the state is a hint (docs/design.md, invariant 3), and a
reclaimed sequence that comes back is resent in full or recomputed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import prometheus_client

EXPIRED = prometheus_client.Counter(
    "specdecode_sequence_leases_expired", "Sequences whose state this service reclaimed "
    "because no call named them for --sequence-lease-seconds (a release that never came).")
HELD = prometheus_client.Gauge(
    "specdecode_sequence_leases", "Sequences with a live lease on this service: every "
    "sequence whose state (delta token store, KV cache) it may hold.")

MAX_LEASES = 1 << 16  # beyond this many, the least recently touched lease ends early


class Leases:
    """When each sequence was last named in a call, least recent first."""

    def __init__(self, seconds: float, max_leases: int = MAX_LEASES,
                 clock: Callable[[], float] = time.monotonic):
        if not seconds > 0:
            raise ValueError(f"--sequence-lease-seconds: must be > 0, got {seconds}")
        self.seconds, self.max_leases, self.clock = seconds, max_leases, clock
        self._touched: OrderedDict[int, float] = OrderedDict()  # seq id -> last call

    def __len__(self) -> int:
        return len(self._touched)

    @property
    def check_interval(self) -> float:
        """How often to look for expired leases: a lease outlives its time by at most this."""
        return min(self.seconds / 4, 5.0)

    def touch(self, seq_ids: Iterable[int]) -> None:
        now = self.clock()
        for seq_id in seq_ids:
            self._touched[seq_id] = now
            self._touched.move_to_end(seq_id)

    def forget(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._touched.pop(seq_id, None)

    def expired(self) -> list[int]:
        """End the leases that ran out (and the least recent beyond max_leases); their ids."""
        cutoff = self.clock() - self.seconds
        ended = []
        while self._touched:
            seq_id, touched = next(iter(self._touched.items()))
            if touched > cutoff and len(self._touched) <= self.max_leases:
                break
            del self._touched[seq_id]
            ended.append(seq_id)
        return ended
