"""`--compile auto|on|off` and `--compile-cache`: whether a service's forwards are compiled,
when, and where what was compiled is kept (docs/design.md, Executor: compiled forwards).

- off: eager forwards.
- on: the decode and verify forwards compiled (specdecode.executor.compiled_forward), where
  they can run: the fast path with batch-dependent numerics (`--deterministic on` keeps its
  own attention, eager; the runner logs why). On an accelerator the graphs compile at
  start-up, before the service serves. On CPU they compile in a background thread while the
  service serves eagerly, a forward taking the graph of its shape once that one is ready
  (compiling costs 20-70 s a graph on 2 cores: docs/benchmarks.md, *Compiled forwards*).
- auto (the default): on on an accelerator, off on CPU, where the compiled forwards were not
  faster than the eager ones the services run (docs/benchmarks.md, *Compiled forwards*) and
  finding out at each start would cost a graph's compilation beside the traffic.

Graphs come from inductor's on-disk caches where they were compiled before with the same
shapes, options and torch version (`--compile-cache DIR`, which sets TORCHINDUCTOR_CACHE_DIR;
a volume there keeps them across container restarts), so a restart reloads them instead of
compiling them again.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line offers the modes without loading torch
    import torch

    from specdecode.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class CompilePlan:
    """What ModelRunner is given: enforce_eager (True: never compiled), compile_now (False:
    compiled later, by BackgroundCompile)."""

    enforce_eager: bool
    compile_now: bool


def compile_plan(mode: str, device: torch.device, cache_dir: str | None = None) -> CompilePlan:
    """The runner's arguments for --compile `mode` on `device`; points inductor's caches at
    `cache_dir` (None: TORCHINDUCTOR_CACHE_DIR, else inductor's default under /tmp)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile: {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if cache_dir and mode != "off":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)
    on = mode == "on" or (mode == "auto" and device.type != "cpu")
    return CompilePlan(enforce_eager=not on, compile_now=device.type != "cpu")


class BackgroundCompile:
    """Compiles a runner's graphs in a daemon thread (start()), decode at one row first."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.thread = threading.Thread(target=self.run, name="background-compile", daemon=True)

    @staticmethod
    def needed(runner: ModelRunner) -> bool:
        """Whether `runner` has compiled forwards waiting to be compiled."""
        compiled = runner.compiled
        return compiled is not None and not compiled.ready

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        compiled = self.runner.compiled
        try:
            compiled.compile()
        except Exception:  # a failed compilation leaves the service serving eagerly
            log.exception("compiling the forwards failed: they stay eager")
            compiled.drop()
        else:
            log.info("compiled forwards ready: %d graphs in %.1f s (%d reloaded from the "
                     "compile cache %s)", compiled.stats.graphs, compiled.stats.seconds,
                     compiled.stats.cache_hits, os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                                               "(inductor's default)"))
