"""The only scorer, behind a TCP relay (tests.support.relay), over real processes
(docs/design.md, *Faults and replicas*):

- a link that goes quiet: the relay stops forwarding while keeping both sockets open;
  keepalive pings (--keepalive-interval 1 s, --keepalive-timeout 2.5 s) close the connection,
  the scorer is down and health follows (HTTP /health 503, gRPC NOT_SERVING) within 5 s;
  once the relay forwards again the scorer is back within 20 s, and a stream decodes the
  target's own tokens;
- a rolling restart: with the default --scorer-retry-timeout, which covers a scorer's cold
  start, a greedy and a seeded sampled stream running when the scorer gets SIGTERM wait for
  it to come back (same address) and complete with the output of an undisturbed run. The
  scorer is stopped (SIGSTOP) once the streams are under way, so the SIGTERM meets them
  mid-stream however fast the machine.

Bounds are the configured timers', not speeds."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdecode.api.client import SpecDecodeClient
from tests.support.cluster import Cluster
from tests.support.references import reference_greedy
from tests.support.relay import Relay

PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8]]
MAX_TOKENS = 64
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}


@pytest.fixture(scope="module")
def relayed(tiny_model_dirs, tmp_path_factory):
    """(cluster, relay): the orchestrator reaches its only scorer through the relay."""
    cluster = Cluster(tiny_model_dirs, tmp_path_factory.mktemp("only_scorer"), http=True)
    for name in [*cluster.scorers, *cluster.proposers]:
        cluster.start_service(name, wait=False)
    for name in [*cluster.scorers, *cluster.proposers]:
        cluster.wait_serving(name)
    with Relay(cluster.ports["scorer0"]) as relay:
        try:
            cluster.start_orchestrator("orchestrator", "--scorer", relay.address)
            yield cluster, relay
        finally:
            cluster.stop()


def http_status(base: str) -> int:
    try:
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        json.loads(e.read())
        return e.code


def grpc_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=5).status


def run(address: str, prompt: list[int], arrived=None, **params) -> tuple[list[int], str]:
    tokens, finish = [], None
    with SpecDecodeClient(address) as client:
        for response in client.stream(prompt, max_tokens=MAX_TOKENS, **params):
            tokens += response.token_ids
            finish = response.finish_reason or finish
            if arrived is not None:
                arrived.append(len(tokens))
    return tokens, finish


def test_quiet_link_to_the_only_scorer_is_down_within_5s_and_back(relayed, target_model):
    cluster, relay = relayed
    address = cluster.address("orchestrator")
    assert http_status(cluster.http) == 200
    relay.quiet()
    down = cluster.wait_for(lambda: http_status(cluster.http) != 200, 5,
                            "/health non-200 after the link went quiet")
    assert http_status(cluster.http) == 503
    assert grpc_health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert cluster.metric("orchestrator", "specdecode_replica_up", 'role="scorer"') == 0
    time.sleep(2)  # quiet a while longer: reconnections meet a quiet relay too
    relay.resume()
    back = cluster.wait_for(lambda: http_status(cluster.http) == 200, 20,
                            "/health 200 after the link forwards again")
    assert grpc_health(address) == health_pb2.HealthCheckResponse.SERVING
    with SpecDecodeClient(address) as client:
        tokens = client.generate(PROMPTS[0], max_tokens=24).token_ids
    assert tokens == reference_greedy(target_model, PROMPTS[0], 24)
    print(f"\nquiet link: /health 503 after {down:.2f}s; 200 again {back:.2f}s after the "
          f"relay forwarded again")


def test_restart_of_the_only_scorer_ends_no_stream(relayed, target_model):
    cluster, _ = relayed
    address = cluster.address("orchestrator")
    cluster.wait_for(lambda: http_status(cluster.http) == 200, 30, "serving")
    undisturbed = run(address, PROMPTS[1], **SAMPLED)[0]
    arrived: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        greedy = pool.submit(run, address, PROMPTS[0], arrived, num_speculative_tokens=0)
        sampled = pool.submit(run, address, PROMPTS[1], **SAMPLED)
        cluster.wait_for(lambda: len(arrived) >= 3, 60, "the streams under way")
        scorer = cluster.processes["scorer0"]
        scorer.send_signal(signal.SIGSTOP)
        assert not (greedy.done() or sampled.done()), "the streams ended before the stop"
        stopped_at = len(arrived)
        scorer.send_signal(signal.SIGTERM)
        scorer.send_signal(signal.SIGCONT)
        scorer.wait(60)
        down = time.monotonic()
        cluster.start_service("scorer0")
        cold_start = time.monotonic() - down
        greedy_tokens, greedy_finish = greedy.result(120)
        sampled_tokens, sampled_finish = sampled.result(120)
    assert stopped_at < len(arrived), "the stream went on after the restart"
    assert greedy_finish and sampled_finish, (greedy_finish, sampled_finish)
    assert greedy_tokens == reference_greedy(target_model, PROMPTS[0], MAX_TOKENS)
    assert sampled_tokens == undisturbed
    assert cluster.metric("orchestrator", "specdecode_requests_total", 'outcome="error"') == 0
    print(f"\nscorer restarted in {cold_start:.1f}s (exit to SERVING) under two streams; "
          f"both completed with the undisturbed output")
