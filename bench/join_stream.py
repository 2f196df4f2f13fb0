"""A stream with a long request joining beside it (chunked prefill, docs/design.md), for
tests/integration/test_long_prompt_join.py and bench/join_bench.py. Lives in bench/, which
both can import without installing it (a script's own folder is on its path, the repository
root on pytest's)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from specdecode.api.client import SpecDecodeClient

JOIN_AT, BEFORE, AFTER = 40, 30, 10  # the stream's tokens: join at, measured before, after


def gaps_of(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


@dataclass
class Joined:
    times: list[float] = field(default_factory=list)  # arrival of each streamed message
    tokens: list[int] = field(default_factory=list)  # the stream's tokens
    long_tokens: list[int] = field(default_factory=list)  # the long request's output
    start: float = 0.0  # the long request's send and answer times (perf_counter)
    end: float = float("inf")

    @property
    def window(self) -> list[float]:
        """The stream's gaps from BEFORE tokens before the join to the end."""
        return gaps_of(self.times)[JOIN_AT - BEFORE:]

    @property
    def seconds(self) -> float:
        return self.end - self.start


def stream_with_join(client: SpecDecodeClient, short: list[int], long: list[int],
                     long_max_tokens: int, stream_max_tokens: int) -> Joined:
    """Stream `short`; after JOIN_AT messages send `long` beside it; cancel the stream AFTER
    messages after the long request's answer (or at its own end)."""
    out = Joined()

    def join() -> None:
        out.start = time.perf_counter()
        out.long_tokens = client.generate(long, max_tokens=long_max_tokens).token_ids
        out.end = time.perf_counter()

    thread = threading.Thread(target=join)
    call = client.stream(short, max_tokens=stream_max_tokens)
    for response in call:
        out.times.append(time.perf_counter())
        out.tokens += response.token_ids
        if len(out.times) == JOIN_AT:
            thread.start()
        if sum(t > out.end for t in out.times) > AFTER:
            call.cancel()
            break
    thread.join()
    return out
