"""What each service cost in one step: bytes each way, time busy and idle, full resends.

Remote clients (orchestrator.cluster.remote) keep cumulative counters (`bytes_sent`,
`bytes_received`, `service_seconds` as reported by the service, `full_resends`); the engine
snapshots them around a step and keeps the difference. In-process parts have no counters:
their stats stay zero.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServiceStats:
    bytes_sent: int = 0  # to the service
    bytes_received: int = 0  # from the service
    busy_s: float = 0.0  # time the service reported working on its calls
    idle_s: float = 0.0  # the step's wall time minus busy_s (0 when calls span steps)
    full_resends: int = 0  # sequences resent in full because the service lacked their prefix


def snapshot(part) -> ServiceStats:
    """The cumulative counters of a proposer or scorer (zeros for an in-process one)."""
    return ServiceStats(getattr(part, "bytes_sent", 0), getattr(part, "bytes_received", 0),
                        getattr(part, "service_seconds", 0.0), 0.0,
                        getattr(part, "full_resends", 0))


def step_stats(before: ServiceStats, after: ServiceStats, step_s: float) -> ServiceStats:
    busy = after.busy_s - before.busy_s
    return ServiceStats(after.bytes_sent - before.bytes_sent,
                        after.bytes_received - before.bytes_received, busy,
                        max(step_s - busy, 0.0), after.full_resends - before.full_resends)
