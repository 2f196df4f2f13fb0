"""The stream write timeout (`--stream-write-timeout`): a client that has taken nothing for
that long while its outputs waited is cancelled, and its sequences released on both
services (docs/design.md, *Back-pressure*).

gRPC: a generation's watch (`StreamWatch`) measures its outbox (orchestrator.engine.outbox):
outputs wait only while the stream's write is blocked on the client's flow-control window.
HTTP: the connection's writes are paused (asyncio's write buffer above its high-water mark,
the kernel's socket buffers full) for that long, and the connection is closed
(orchestrator.frontend.http_server); its generation ends as any client's that leaves. In
both, the bytes that the kernel's buffers and the client's window absorbed come first: the
clock starts only once they are full.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import Counter

from orchestrator.engine.outbox import Outbox

WRITE_TIMEOUTS = Counter(
    "specdecode_stream_write_timeouts", "Streams cancelled because their client took nothing "
    "for --stream-write-timeout seconds while output waited, by API.", ["api"])


class StreamWatch:
    """Calls `on_expire` once, on the event loop, when `outbox` has been stalled (outputs
    waiting, none taken) for `timeout_s`; one timer, re-armed for what is left of it."""

    def __init__(self, outbox: Outbox, timeout_s: float, on_expire: Callable[[], None]):
        self.outbox, self.timeout_s, self.on_expire = outbox, timeout_s, on_expire
        self.expired = False
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> StreamWatch:
        self._arm(self.timeout_s)
        return self

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, seconds: float) -> None:
        self._handle = asyncio.get_running_loop().call_later(seconds, self._check)

    def _check(self) -> None:
        stalled = self.outbox.stalled_for()
        if stalled < self.timeout_s:
            self._arm(self.timeout_s - stalled)
            return
        self._handle, self.expired = None, True
        self.on_expire()
