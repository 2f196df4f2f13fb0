"""One model call at a time, off the event loop, and stopped when its caller is gone
(docs/security.md: no orphaned forwards).

When a call is cancelled (the client went away or its deadline passed, and grpc.aio
cancels the handler), the forward pass running in the worker thread is stopped at its
next module boundary: a process-wide forward pre-hook raises `ForwardStopped` in the thread
whose call was cancelled (a compiled forward is not stopped: it runs whole). The lock is held until that thread has really returned, so a
second forward never runs beside a stopped one. The model runner writes its KV cache only
after a forward completes, so a stopped forward leaves the cache as it was.

The service's own work (re-measuring its forward costs while idle, specdecode.serving.recalibration)
yields to traffic the same way: a traffic call that arrives while it runs stops it at its next
module, and it does not start once a traffic call came while it waited for the lock (both
raise `ForwardStopped` to it). Traffic never waits for a calibration cell: the orchestrator
learns what drafting and verifying cost from its steps' times, and a first speculative step
that waited for a cell (seconds, with real models) priced speculation off for good (issue
31: an orchestrator started while the services re-measured decoded plainly).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import time

import prometheus_client
import torch

STOPPED = prometheus_client.Counter(
    "specdecode_model_calls_stopped", "Model calls stopped because their caller went away "
    "(cancelled, or its deadline passed).")

_local = threading.local()  # .stop: the threading.Event of the call this thread runs
_hook_installed = False


class ForwardStopped(Exception):
    """Raised inside a model forward whose call was cancelled."""


def _stop_if_cancelled(module, args) -> None:
    # A compiled forward (specdecode.executor.compiled_forward) runs whole: traced, this
    # hook made its graph guard on the compiling thread's state, and a background-compiled
    # graph was compiled again for the serving thread.
    if torch.compiler.is_compiling():
        return
    stop = getattr(_local, "stop", None)
    if stop is not None and stop.is_set():
        raise ForwardStopped("the call was cancelled")


def _install_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        torch.nn.modules.module.register_module_forward_pre_hook(_stop_if_cancelled)
        _hook_installed = True


class ModelAccess:
    def __init__(self):
        _install_hook()
        self._lock = asyncio.Lock()
        self.last_call = time.monotonic()  # when the last traffic call ended (or started)
        self._own: threading.Event | None = None  # stops the service's own call running now

    def idle_for(self) -> float:
        """Seconds since the last traffic call ended; 0 while one runs or waits."""
        return 0.0 if self._lock.locked() else time.monotonic() - self.last_call

    @staticmethod
    def _call(stop: threading.Event, fn, args):
        _local.stop = stop
        try:
            return fn(*args)
        finally:
            _local.stop = None

    async def run(self, fn, *args, traffic: bool = True):
        """fn(*args) in a worker thread, one call at a time. traffic=False: the service's
        own work (re-measuring its forward costs), which does not end its idle time and
        yields to traffic (ForwardStopped)."""
        if traffic and self._own is not None:
            self._own.set()
        asked = self.last_call
        async with self._lock:
            stop = threading.Event()
            if traffic:
                self.last_call = time.monotonic()
            elif self.last_call != asked:
                raise ForwardStopped("a traffic call came first")
            else:
                self._own = stop
            call = functools.partial(contextvars.copy_context().run, self._call, stop, fn, args)
            future = asyncio.get_running_loop().run_in_executor(None, call)
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                stop.set()
                STOPPED.inc()
                while not future.done():  # keep the lock until the thread has returned
                    try:
                        await asyncio.wait([future])
                    except asyncio.CancelledError:
                        pass
                if not future.cancelled():
                    future.exception()  # retrieved: ForwardStopped is expected here
                raise
            finally:
                if traffic:
                    self.last_call = time.monotonic()
                else:
                    self._own = None
