"""A service's forward-cost table kept on disk across restarts (`--cost-cache DIR`;
docs/design.md, *The policy on every host*, kept across restarts): timing every cell at
start-up was most of a restart (a Qwen 1.5B bf16 scorer on 2 cores served 81-103 s after
spawning, 12 s with its table kept), and the table a restarted process would time on the
same host is the one it timed before, or the one its idle re-measurements replaced it with.

A table is kept under a key of everything its times depend on: the model's files (names and
sizes), the service's role and options (dtype, device, numerics, compile mode, the draft's
head), the grid, torch's version, the threads and CPUs the process may use and the CPU's
model name. A restart takes a kept table only after a check like the idle probe's
(specdecode.serving.recalibration): a decode and a one-row forward at the widest width,
each within DRIFT of the table; else (another host under the same key, a load that came or
went) it times every cell as before and keeps the new table. The re-measured tables replace
the kept one (Recalibrator's `on_replace`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdecode.cost_model import ForwardCosts, drift
from specdecode.executor.calibration import CALIBRATION_ROWS, Calibration, calibrate
from specdecode.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def host_facts() -> dict:
    """What a forward's time depends on beyond the model and its options."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": cpus,
            "cpu_model": cpu_model()}


def model_files(model_dir: Path) -> list[tuple[str, int]]:
    """(name, bytes) of the model's files: another checkpoint under the same path differs."""
    if model_dir.is_file():
        return [(model_dir.name, model_dir.stat().st_size)]
    return sorted((p.name, p.stat().st_size) for p in model_dir.iterdir() if p.is_file())


@dataclass(frozen=True)
class CostCache:
    """Where a table is kept (directory) and the key it is kept under (any JSON object)."""

    directory: Path
    key: dict

    @property
    def path(self) -> Path:
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()
        return self.directory / f"forward-costs-{digest[:20]}.json"

    def load(self) -> ForwardCosts | None:
        """The kept table (None: none kept, unreadable, or kept under another key)."""
        try:
            data = json.loads(self.path.read_text())
            if data["key"] != json.loads(json.dumps(self.key)):
                return None
            return ForwardCosts(data["rows"], data["tokens"], data["seconds"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning("ignoring the kept forward costs %s: %s", self.path, exc)
            return None

    def save(self, costs: ForwardCosts) -> None:
        """Keep `costs` (written whole, then renamed: a reader never sees half a table);
        a failure is logged, never raised (the table is an optimisation)."""
        table = costs.snapshot()
        data = {"key": self.key, "rows": table.rows, "tokens": table.tokens,
                "seconds": table.seconds}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not keep the forward costs in %s: %s", self.directory, exc)


def cost_cache(directory: str | None, model_dir: Path, role: str, options: object,
               **extra) -> CostCache | None:
    """The cache of a service's table (None: no directory given). options: a dataclass of
    the service's model options; extra: other settings its forwards depend on."""
    if not directory:
        return None
    settings = {k: v for k, v in asdict(options).items() if k not in ("model", "compile_cache",
                                                                       "cost_cache")}
    key = {"role": role, "model": str(model_dir.resolve()), "files": model_files(model_dir),
           "options": settings, "extra": extra, "host": host_facts()}
    return CostCache(Path(directory), json.loads(json.dumps(key)))


def agrees(runner: ModelRunner, table: ForwardCosts) -> bool:
    """A decode and a one-row forward at the table's widest width, each timed (after the
    process's first forwards, which pay for thread pools and kernel choices), within DRIFT
    of the table's cells (cost_model.drift)."""
    widest = table.max_width
    probe = Calibration(runner, 1, widest)
    try:
        probe.warm_up(1, widest)
        for width in sorted({1, widest}):
            seconds, cell = probe.cell(1, width), table(1, width)
            if drift(seconds, cell):
                log.info("kept forward costs off at width %d (%.1f ms, kept %.1f ms): timing "
                         "every cell", width, 1e3 * seconds, 1e3 * cell)
                return False
    finally:
        probe.close()
    return True


def calibrate_or_reuse(runner: ModelRunner, cache: CostCache | None,
                       tokens: tuple[int, ...]) -> ForwardCosts:
    """The table kept in `cache` when its grid is this one (the row counts traffic added to
    it by re-measurement too) and a probe agrees with it, else calibrate's (then kept)."""
    kept = cache.load() if cache is not None else None
    if kept is not None and kept.tokens == list(tokens) \
            and set(CALIBRATION_ROWS) <= set(kept.rows) and agrees(runner, kept):
        log.info("forward costs from %s (a decode and a %d-token forward agree with them)",
                 cache.path, kept.max_width)
        return kept
    costs = calibrate(runner, tokens=tokens)
    if cache is not None:
        cache.save(costs)
    return costs
