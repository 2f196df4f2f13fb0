"""Deadlines and cancellation of the orchestrator's internal calls (docs/design.md, invariant
6: no request waits on a dead peer).

Every proposer and scorer call has a timeout. Unless an option fixes it, the timeout is sized
from the step's work: a floor plus a safety factor times the tokens the call asks for at the
per-token time observed on earlier successful calls (a moving average). A step's calls
never outlive the latest client deadline among its requests: the engine sets that bound
around the step (`bounded_by`), and the clients read it (`remaining`).

A call made under a `Cancel` (`cancelled_by`) ends as soon as it is cancelled, raising
CallCancelled: a lookahead whose proposals lost their use (orchestrator.engine.lookahead).
The remote clients stop the call on the wire (the service stops its forward); a cancelled
call says nothing about its replica's health.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from specdecode.sequence import ExecuteModelRequest

# The latest client deadline (time.monotonic()) of the running step's requests; None when
# some request has none (then only the call timeouts bound the step).
_step_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "specdecode_step_deadline", default=None)


@contextmanager
def _scoped(var: contextvars.ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def bounded_by(deadline: float | None):
    """The step's calls never outlive `deadline` (time.monotonic(); None: no bound)."""
    return _scoped(_step_deadline, deadline)


def remaining() -> float | None:
    """Seconds left before the step's client deadline, or None when there is none."""
    deadline = _step_deadline.get()
    return None if deadline is None else deadline - time.monotonic()


class CallCancelled(Exception):
    """A call ended because its Cancel was set (not a failure of the service)."""


class Cancel:
    """A cancellation the engine may signal to the calls made under it (`cancelled_by`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._set = False
        self._callbacks: list = []

    @property
    def is_set(self) -> bool:
        return self._set

    def cancel(self) -> None:
        with self._lock:
            self._set, callbacks, self._callbacks = True, self._callbacks, []
        for callback in callbacks:
            callback()

    def on_cancel(self, callback) -> None:
        """Call `callback()` when cancelled (at once if it already is)."""
        with self._lock:
            if not self._set:
                self._callbacks.append(callback)
                return
        callback()


_cancel: contextvars.ContextVar[Cancel | None] = contextvars.ContextVar(
    "specdecode_call_cancel", default=None)


def cancelled_by(cancel: Cancel | None):
    """The calls made in this block end when `cancel` is set (CallCancelled)."""
    return _scoped(_cancel, cancel)


def current_cancel() -> Cancel | None:
    return _cancel.get()


def step_tokens(req: ExecuteModelRequest) -> int:
    """Tokens a step asks a service to compute at most: a prompt's or a prompt chunk's
    whole length (the prefix so far: a service may also have lost its cache), the k+1
    scored positions of a decoding sequence. A chunk is the only non-prompt row without
    output tokens (orchestrator.engine.core._group)."""
    k = req.num_lookahead_slots
    return sum(sg.data.get_len() if sg.is_prompt or not sg.data.output_token_ids else k + 1
               for sg in req.seq_group_metadata_list)


@dataclass
class CallTimeout:
    """The timeout of one kind of call. fixed_s > 0 fixes it; else
    floor_s + factor x (seconds per token, moving average) x tokens."""

    fixed_s: float = 0.0
    floor_s: float = 2.0
    factor: float = 4.0
    seconds_per_token: float = 0.05  # a first guess (SmolLM2 on 2 CPU cores), then observed
    smoothing: float = 0.2

    def timeout(self, tokens: int, scale: float = 1.0) -> float:
        if self.fixed_s > 0:
            budget = self.fixed_s * scale
        else:
            budget = (self.floor_s + self.factor * self.seconds_per_token * tokens) * scale
        left = remaining()
        return budget if left is None else max(0.0, min(budget, left))

    def observe(self, seconds: float, tokens: int) -> None:
        """Record a successful call."""
        if tokens > 0:
            self.seconds_per_token += self.smoothing * (seconds / tokens - self.seconds_per_token)
