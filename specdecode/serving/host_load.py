"""How busy other processes keep this service's CPUs: Linux's /proc/stat for the CPUs the
process may run on, less the process's own CPU time. The recalibrator times forwards only
while the host, not just the service, is idle (docs/design.md, forward costs): a proposer
with no calls (the policy decoding plainly) re-measured beside the scorer's decodes on a
shared host, slowing them and publishing tables ~1.8x too dear."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

HOST_BUSY = 0.25  # other work kept this share of the allowed CPUs busy: the host is busy
PROC_STAT = "/proc/stat"


def busy_seconds(cpus: set[int], stat: str = PROC_STAT) -> float | None:
    """CPU seconds the given CPUs spent on anything but idle and I/O wait since boot (None
    where the file cannot be read: not Linux)."""
    try:
        with open(stat) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    jiffies = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            jiffies += sum(values) - values[3] - values[4]
    return jiffies / os.sysconf("SC_CLK_TCK")


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (all of them where the OS cannot say: not Linux)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


class HostLoad:
    """others_busy(): the share of the allowed CPUs that other processes kept busy since the
    previous call (0 where it cannot be known)."""

    def __init__(self, cpus: set[int] | None = None,
                 read: Callable[[set[int]], float | None] = busy_seconds):
        self.cpus = set(cpus or allowed_cpus())
        self.read = read
        self._mark = self._now()

    def _now(self) -> tuple[float, float | None, float]:
        return time.monotonic(), self.read(self.cpus), time.process_time()

    def others_busy(self) -> float:
        (t0, busy0, own0), now = self._mark, self._now()
        self._mark = now
        t1, busy1, own1 = now
        if busy0 is None or busy1 is None or t1 <= t0:
            return 0.0
        return max(busy1 - busy0 - (own1 - own0), 0.0) / ((t1 - t0) * len(self.cpus))

    def busy(self) -> bool:
        return self.others_busy() > HOST_BUSY
