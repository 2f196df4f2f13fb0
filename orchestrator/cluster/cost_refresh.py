"""Hands the speculation policy the forward-cost tables its services re-measured while idle
(specdecode.serving.recalibration): every REFRESH_S, the first replica up of each service is asked
for its ModelInfo, and a re-measured table (version > 0) of another version (or from another
replica) than the last one seen replaces the policy's (SpeculationPolicy.update_table).

A start-up table (version 0) is never adopted: a restarted replica's (or another one's)
measures nothing newer than the table the policy holds, and adopting it made the policy
forget what its steps had learned while no sequence was running to check the table again
(after a proposer restart, short requests stopped speculating). The replica's own
re-measurements are adopted as they come: it counts them from 1 again."""

from __future__ import annotations

import logging
import threading

import grpc

from orchestrator.cluster.replicas import ReplicaSet
from orchestrator.engine.speculation_policy import SpeculationPolicy

log = logging.getLogger(__name__)

REFRESH_S = 5.0


class CostRefresh:
    def __init__(self, policy: SpeculationPolicy, services: dict[str, ReplicaSet],
                 interval_s: float = REFRESH_S):
        """services: role ("proposer" | "scorer") -> its replicas."""
        self.policy, self.services, self.interval_s = policy, services, interval_s
        self.seen: dict[str, tuple[str | None, int]] = {}  # role -> (replica, version) held
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cost-refresh", daemon=True)

    @classmethod
    def started(cls, policy: SpeculationPolicy, services: dict[str, tuple]) -> CostRefresh:
        """services: role -> (its routed client, the ModelInfo the policy was built from);
        a service without a table (the n-gram proposer) is not asked."""
        tables = {role: (routed.replicas, info.forward_cost)
                  for role, (routed, info) in services.items() if info.forward_cost is not None}
        refresh = cls(policy, {role: replicas for role, (replicas, _) in tables.items()})
        refresh.start({role: costs.version for role, (_, costs) in tables.items()})
        return refresh

    def start(self, first: dict[str, int]) -> None:
        """first: role -> the version of the table the policy was built with."""
        self.seen = {role: (None, v) for role, v in first.items()}
        self._thread.start()

    def poll(self) -> None:
        for role, replicas in self.services.items():
            up = replicas.first_up()
            if up is None:
                continue
            address, client = up
            try:
                costs = client.model_info().forward_cost
            except grpc.RpcError as exc:
                log.debug("cost table of the %s at %s: %s", role, address, exc)
                continue
            if costs is None:
                continue
            held, self.seen[role] = self.seen.get(role), (address, costs.version)
            if costs.version == 0 or held in ((address, costs.version), (None, costs.version)):
                continue  # a start-up table, or the table the policy holds
            log.info("adopting the %s's re-measured forward costs (%s, version %d)", role,
                     address, costs.version)
            self.policy.update_table(role, costs)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # keep refreshing
                log.exception("refreshing the forward costs failed")

    def close(self) -> None:
        self._stop.set()
