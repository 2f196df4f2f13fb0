"""Routing and deadline rules in isolation: the hash ring's affinity and balance, address
resolution, call timeouts sized from a step's work and bounded by the client's deadline, and
which failures take a replica off the ring."""

from __future__ import annotations

import random
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from orchestrator.engine import deadlines
from orchestrator.engine.deadlines import CallTimeout, step_tokens
from orchestrator.cluster.replicas import ReplicaSet
from orchestrator.cluster.routing import HashRing, resolve, split_address
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)

REPLICAS = ["10.0.0.1:50053", "10.0.0.2:50053", "10.0.0.3:50053"]
# Sequence ids as the engine makes them: a random 38-bit prefix and a counter.
SEQ_IDS = [random.Random(0).getrandbits(38) << 24 | n for n in range(3000)]


def test_ring_spreads_sequences_over_replicas():
    ring = HashRing(REPLICAS)
    shares = Counter(ring.owner(s) for s in SEQ_IDS)
    assert set(shares) == set(REPLICAS)
    # 64 points per replica: each share within 25% of a third (measured: within ~10%).
    assert all(abs(n - 1000) < 250 for n in shares.values()), shares


def test_only_a_failed_replicas_sequences_move_and_they_come_back():
    full, without = HashRing(REPLICAS), HashRing(REPLICAS[:2])
    for s in SEQ_IDS:
        if full.owner(s) != REPLICAS[2]:
            assert without.owner(s) == full.owner(s)  # affinity kept for the others
        else:
            assert without.owner(s) in REPLICAS[:2]
    assert [HashRing(REPLICAS).owner(s) for s in SEQ_IDS] == [full.owner(s) for s in SEQ_IDS]


def test_empty_ring_has_no_owner():
    assert HashRing([]).owner(7) is None


def test_resolve_addresses():
    assert resolve("127.0.0.1:5,127.0.0.1:6") == (
        [("127.0.0.1:5", "127.0.0.1:5"), ("127.0.0.1:6", "127.0.0.1:6")], [])
    assert resolve("localhost:7")[0] == [("127.0.0.1:7", "localhost:7")]  # one replica, not two
    assert resolve("[::1]:8")[0] == [("[::1]:8", "[::1]:8")]
    assert resolve("no-such-host.invalid:9") == ([], ["no-such-host.invalid:9"])
    with pytest.raises(ValueError, match="'scorer': expected HOST:PORT"):
        split_address("scorer")


def request(prompt_len: int, output_len: int, k: int) -> ExecuteModelRequest:
    groups = [SequenceGroupMetadata("r", output_len == 0, {
        0: SequenceData(list(range(prompt_len)), list(range(output_len)))}, SamplingParams())]
    return ExecuteModelRequest(groups, num_lookahead_slots=k)


def test_timeout_grows_with_the_steps_work():
    assert step_tokens(request(100, 0, 4)) == 100  # a prompt: all of it
    assert step_tokens(request(100, 5, 4)) == 5  # then the k + 1 scored positions
    chunk = request(300, 0, 1)  # a prompt chunk (chunked prefill): the prefix so far
    chunk.seq_group_metadata_list[0].is_prompt = False
    assert step_tokens(chunk) == 300
    t = CallTimeout(floor_s=2.0, factor=4.0, seconds_per_token=0.01)
    assert t.timeout(0) == 2.0 and t.timeout(100) == pytest.approx(6.0)
    for _ in range(50):
        t.observe(1.0, 10)  # 0.1 s per token observed
    assert t.seconds_per_token == pytest.approx(0.1, rel=1e-3)
    assert CallTimeout(fixed_s=1.5).timeout(10_000) == 1.5


def test_client_deadline_bounds_every_call():
    t = CallTimeout(fixed_s=30.0)
    with deadlines.bounded_by(time.monotonic() + 2.0):
        assert 1.5 < t.timeout(1) <= 2.0
    with deadlines.bounded_by(time.monotonic() - 1):
        assert t.timeout(1) == 0.0
    with deadlines.bounded_by(None):
        assert t.timeout(1) == 30.0


def test_a_timeout_never_takes_the_last_replica_off():
    """A failed call takes its replica off the ring; a merely slow one (timed out) only
    while another replica is up to take its sequences."""
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    replicas = ReplicaSet("scorer", ",".join(addresses),
                          lambda channel, address: SimpleNamespace(channel=channel), [])
    try:
        replicas._resolve()
        for address in addresses:
            replicas._set_up(address, True, "test")
        timeout = RuntimeError("DEADLINE_EXCEEDED")
        assert replicas.failed(addresses[0], timeout, slow=True)  # another is up
        assert not replicas.failed(addresses[1], timeout, slow=True)  # the last one stays
        assert replicas.up_count() == 1 and replicas.route([7]).keys() == {addresses[1]}
        assert replicas.failed(addresses[1], RuntimeError("UNAVAILABLE"))  # gone: off
        assert replicas.up_count() == 0 and replicas.route([7]) == {}
    finally:
        replicas.close()
