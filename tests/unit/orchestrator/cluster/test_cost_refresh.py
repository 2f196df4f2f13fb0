"""CostRefresh hands the policy the tables its services re-measured, and only those: a
replica restarted at the same address reports its start-up table (version 0) again, which
must not replace (and so wipe) what the policy holds and learned."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator.cluster.cost_refresh import CostRefresh
from specdecode.cost_model import ForwardCosts

ADDRESS = "127.0.0.1:5000"


def costs(version: int) -> ForwardCosts:
    return ForwardCosts([1], [1, 2], [[0.01, 0.011]], version)


class Replica:
    """The first replica up of a service: its address and the table it reports."""

    def __init__(self, address: str, version: int):
        self.address, self.version = address, version

    def first_up(self):
        return self.address, self

    def model_info(self):
        return SimpleNamespace(forward_cost=costs(self.version))


class Policy:
    def __init__(self):
        self.adopted: list[tuple[str, int]] = []

    def update_table(self, role: str, table: ForwardCosts) -> None:
        self.adopted.append((role, table.version))


def refresh(replica: Replica, built_with: int) -> tuple[CostRefresh, Policy]:
    policy = Policy()
    cost_refresh = CostRefresh(policy, {"proposer": replica})
    cost_refresh.seen = {"proposer": (None, built_with)}  # as start() sets it
    return cost_refresh, policy


def test_a_restarted_replicas_start_up_table_is_not_adopted():
    replica = Replica(ADDRESS, 0)
    cost_refresh, policy = refresh(replica, 0)
    cost_refresh.poll()
    replica.version = 2  # re-measured twice while idle
    cost_refresh.poll()
    assert policy.adopted == [("proposer", 2)]
    replica.version = 0  # killed and restarted on the same address: its start-up table
    cost_refresh.poll()
    cost_refresh.poll()
    assert policy.adopted == [("proposer", 2)]
    replica.version = 1  # the restarted process's first re-measurement is new
    cost_refresh.poll()
    assert policy.adopted == [("proposer", 2), ("proposer", 1)]


def test_another_replicas_re_measured_table_is_adopted_its_start_up_table_not():
    replica = Replica(ADDRESS, 1)
    cost_refresh, policy = refresh(replica, 1)
    cost_refresh.poll()  # the table the policy was built with
    replica.address = "127.0.0.1:5001"  # the first one went down: another is first up
    replica.version = 0
    cost_refresh.poll()
    assert policy.adopted == []
    replica.version = 1
    cost_refresh.poll()
    assert policy.adopted == [("proposer", 1)]
