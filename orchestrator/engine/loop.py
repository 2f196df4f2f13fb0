"""Runs the engine's step loop on its own thread and hands results to asyncio handlers.

Requests and cancellations queue up and join at the next step boundary. A failed step
(a service went away) fails the requests of that step with the error and leaves the loop
running for the next ones.

Trace context does not follow work onto this thread by itself: each Request carries its
request span's context (`Request.trace_context`), which the engine's step spans attach to.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from orchestrator.engine.request import Request, StepOutput
from orchestrator.engine.core import SpecDecodeEngine
from orchestrator.engine.step_stats import StepStats
from specdecode.api.usage import Usage
from specdecode.telemetry import tracing
from specdecode.errors import InvalidRequestError

log = logging.getLogger(__name__)

Sink = Callable[[StepOutput | BaseException], None]


class EngineLoop:
    def __init__(self, engine: SpecDecodeEngine,
                 on_step: Callable[[StepStats], None] | None = None,
                 max_running: int | None = None):
        self.engine = engine
        self.on_step = on_step
        self.max_running = max_running  # None = no limit; the rest wait in `_waiting`
        self._cv = threading.Condition()
        self._pending: list[tuple[Request, Sink]] = []
        self._waiting: collections.deque[tuple[Request, Sink]] = collections.deque()
        self._aborts: list[str] = []
        self._cancel_all = False
        self._sinks: dict[str, Sink] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()

    @property
    def waiting(self) -> int:
        """Requests submitted that have not joined a step yet (new, or queued for a running
        slot)."""
        return len(self._pending) + len(self._waiting)

    def submit(self, request: Request, sink: Sink) -> None:
        """Join at the next step; sink receives each StepOutput, or the exception that
        ended the request (InvalidRequestError if it could not be added)."""
        with self._cv:
            self._pending.append((request, sink))
            self._cv.notify()

    def wake(self) -> None:
        """A paused sequence's client took an output (orchestrator.engine.outbox): it may
        join the next step. Any thread."""
        with self._cv:
            self._cv.notify()

    @property
    def paused(self) -> int:
        """Running sequences paused because their clients' outputs are full."""
        return sum(1 for s in list(self.engine.running.values()) if s.paused)

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def cancel_all(self) -> None:
        """At the next step boundary, end every request with finish reason "cancelled"
        (its sink gets a last StepOutput) and release its sequence on the services (a
        draining server whose grace is running out; Frontend.cancel_all ends the public
        streams at once). Requests still running when the loop stops are released too."""
        with self._cv:
            self._cancel_all = True
            self._cv.notify()

    def _take_commands(self) -> tuple[list[tuple[Request, Sink]], list[str]] | None:
        with self._cv:
            # Queued requests are work too: when the running ones all finish in one step,
            # the next round admits them (waiting here instead stranded them for good).
            # Paused sequences are not (has_unfinished): a client's take wakes the loop.
            while not (self._stopped or self._pending or self._aborts or self._cancel_all
                       or self._can_admit() or self.engine.has_unfinished()):
                self._cv.wait()
            if self._stopped:
                return None
            pending, aborts = self._pending, self._aborts
            self._pending, self._aborts = [], []
            cancel_all, self._cancel_all = self._cancel_all, False
            return pending, aborts, cancel_all

    def _can_admit(self) -> bool:
        """A queued request and a running slot for it (paused sequences hold theirs)."""
        return bool(self._waiting) and (self.max_running is None
                                        or len(self.engine.running) < self.max_running)

    def _run(self) -> None:
        try:
            self._serve()
        finally:  # stopped (the server is gone): free what still runs on the services
            for request_id in list(self.engine.running):
                self._guard(self.engine.abort, request_id)

    def _serve(self) -> None:
        while (commands := self._take_commands()) is not None:
            pending, aborts, cancel_all = commands
            self._waiting.extend(pending)
            if cancel_all:
                self._cancel(list(self._waiting))
                self._waiting.clear()
            for request_id in aborts:
                self._sinks.pop(request_id, None)
                self._guard(self.engine.abort, request_id)
            if aborts:
                gone = set(aborts)
                self._waiting = collections.deque(
                    (r, s) for r, s in self._waiting if r.request_id not in gone)
            while self._can_admit():
                request, sink = self._waiting.popleft()
                try:
                    self.engine.add_request(request)
                    self._sinks[request.request_id] = sink
                except InvalidRequestError as exc:
                    sink(exc)
            if self.engine.has_unfinished():
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a service failed: end this step's requests, keep serving
            with tracing.in_context(self._oldest_trace_context()):  # the log line's trace
                log.error("step failed, ending %d requests: %s", len(self.engine.running), exc)
            for request_id in list(self.engine.running):
                self._guard(self.engine.abort, request_id)
                sink = self._sinks.pop(request_id, None)
                if sink:
                    sink(exc)
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink:
                sink(out)
            if out.finish_reason:
                self._sinks.pop(out.request_id, None)
        if self.on_step:
            self.on_step(self.engine.last_step)

    def _cancel(self, pending: list[tuple[Request, Sink]]) -> None:
        for request, sink in pending:
            sink(StepOutput(request.request_id, [], "cancelled",
                            Usage(prompt_tokens=len(request.prompt_token_ids))))
        for request_id, seq in list(self.engine.running.items()):
            self._guard(self.engine.abort, request_id)
            sink = self._sinks.pop(request_id, None)
            if sink:
                sink(StepOutput(request_id, [], "cancelled", seq.stats))

    def _oldest_trace_context(self):
        return next((s.request.trace_context for s in self.engine.running.values()
                     if s.request.trace_context is not None), None)

    @staticmethod
    def _guard(fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # releasing state on a service is best effort
            log.warning("%s(%s) failed: %s", getattr(fn, "__name__", fn), args, exc)
