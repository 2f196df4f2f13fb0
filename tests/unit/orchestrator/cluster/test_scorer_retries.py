"""The scorer's retries when its only replica up is slow (orchestrator.cluster.fanout): the
timed-out step is retried there with the rest of the retry budget at once, since a stopped
forward loses its work. The replica set is a stand-in (one replica, always up) whose
client is slower than the call timeout: its calls take `need` seconds, or end
DEADLINE_EXCEEDED at their deadline."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
import torch

from orchestrator.cluster.fanout import RoutedScorer
from orchestrator.engine.deadlines import CallTimeout
from specdecode.errors import ServiceUnavailableError
from specdecode.interfaces import SpeculativeProposals, SpeculativeScores
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)

K = 2


class DeadlineExceeded(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "Deadline Exceeded"


grpc.Call.register(DeadlineExceeded)  # what fanout tells a call's failure by


class SlowClient:
    def __init__(self, need_s: float):
        self.need_s, self.timeouts = need_s, []

    def score_proposals(self, req, proposals, timeout: float) -> SpeculativeScores:
        self.timeouts.append(timeout)
        time.sleep(min(timeout, self.need_s))
        if timeout < self.need_s:
            raise DeadlineExceeded()
        return SpeculativeScores(None, None, torch.zeros(len(req.seq_group_metadata_list),
                                                         K + 1, dtype=torch.long))


class OneReplica:
    """ReplicaSet's surface as RoutedScorer uses it, for one replica that stays up."""

    def __init__(self, client: SlowClient):
        self.client = client
        self.pool = concurrent.futures.ThreadPoolExecutor(2)

    def route(self, seq_ids: list[int]) -> dict:
        return {"scorer:1": (list(range(len(seq_ids))), self.client, [])}

    def up_count(self) -> int:
        return 1

    def down_for(self) -> float:
        return 0.0

    def succeeded(self, address: str) -> None:
        pass

    def failed(self, address: str, exc: BaseException, slow: bool) -> None:
        assert slow, "a timeout keeps the last replica on the ring"

    def describe(self) -> str:
        return "scorer"


def step() -> tuple[ExecuteModelRequest, SpeculativeProposals]:
    group = SequenceGroupMetadata("r", False, {7: SequenceData([1, 2, 3], [4])},
                                  SamplingParams())
    return (ExecuteModelRequest([group], num_lookahead_slots=K),
            SpeculativeProposals(torch.zeros(1, K, dtype=torch.long), None,
                                 torch.tensor([K])))


def test_a_slow_last_replica_gets_the_rest_of_the_budget_at_once():
    """0.1 s deadlines, a 3 s budget, a replica needing 1 s: after the first timeout the
    retry's deadline is the ~2.9 s left, and the step succeeds. Deadlines doubled from
    0.1 s (0.2, 0.4, 0.8, then the 0.8 s left after the back-offs) spent the budget on
    calls that were each stopped short, and the step failed UNAVAILABLE."""
    client = SlowClient(need_s=1.0)
    scorer = RoutedScorer(OneReplica(client), CallTimeout(fixed_s=0.1), retry_timeout_s=3.0)
    scores = scorer.score_proposals(*step())
    assert scores.token_ids.shape == (1, K + 1)
    assert len(client.timeouts) == 2 and client.timeouts[1] > 1.5, client.timeouts


def test_a_replica_slower_than_the_whole_budget_fails_the_step_unavailable():
    client = SlowClient(need_s=5.0)
    scorer = RoutedScorer(OneReplica(client), CallTimeout(fixed_s=0.1), retry_timeout_s=0.5)
    with pytest.raises(ServiceUnavailableError, match="retried for 0s .*DEADLINE_EXCEEDED"):
        scorer.score_proposals(*step())
    assert len(client.timeouts) == 2 and sum(client.timeouts) < 0.7, client.timeouts
