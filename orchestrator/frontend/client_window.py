"""Whether an HTTP client takes what it is sent, read from its connection's TCP state
(docs/design.md, *Back-pressure*).

The server's writes pause only once the client's receive window and the server's own
buffers are full: on Linux's defaults a client that never calls recv absorbs ~150 KB first
(its window grows to ~100 KB as data arrives, then shrinks), ~800 tokens of a streamed
completion, and at a few tokens a second a stream ran for minutes before the write timeout
could start. The window the client advertises says more, sooner: a client that reads keeps
it at its widest (or widens it), one that does not lets it shrink by every byte it is sent.
So "took nothing since" is the last time the window widened or stood at its widest, and a
connection whose window has stayed narrower than its widest for the write timeout is a
client that has not taken a byte for that long. Linux's TCP_INFO has the window since 5.4
(tcpi_snd_wnd); elsewhere `send_window` is None and only paused writes count.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

TCPI_SND_WND = 228  # the offset of tcpi_snd_wnd (u32) in Linux's struct tcp_info
INFO_BYTES = TCPI_SND_WND + 4


def send_window(sock: socket.socket) -> int | None:
    """The receive window the peer last advertised, in bytes (None: not known here)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, INFO_BYTES)
    except (AttributeError, OSError):  # no TCP_INFO (not Linux), or the socket is gone
        return None
    if len(info) < INFO_BYTES:  # a kernel before 5.4
        return None
    return struct.unpack_from("I", info, TCPI_SND_WND)[0]


@dataclass
class ClientWindow:
    """A connection's advertised window over time; `taken_at`: when the client was last
    seen taking bytes (its window widened, or stood at its widest: nothing unread)."""

    taken_at: float
    widest: int = 0
    last: int = 0

    def observe(self, window: int, now: float) -> None:
        if window > self.last or window >= self.widest:
            self.taken_at = now
        self.widest, self.last = max(self.widest, window), window

    def unread_for(self, now: float) -> float:
        """Seconds the client has held unread bytes without taking any (0: it reads)."""
        return 0.0 if self.last >= self.widest else now - self.taken_at
