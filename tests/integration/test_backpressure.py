"""Back-pressure end to end (docs/design.md, *Back-pressure*), over real processes: streaming
clients that never read (HTTP on a raw socket that never calls recv, gRPC streams never
iterated, both with small receive windows) pause their sequences once their output queue
is full, and --stream-write-timeout later are cancelled: the HTTP connections are closed by
the server, the gRPC streams end DEADLINE_EXCEEDED after what was written, and their
sequences are released on both services; a neighbour that reads decodes the target's own
tokens throughout. Waits are bounds on events, not speeds."""

from __future__ import annotations

import concurrent.futures
import re
import time

import grpc
import pytest

from specdecode.api.client import SpecDecodeClient
from tests.support.cluster import Cluster
from tests.support.references import reference_greedy
from tests.support.stalled_clients import closed_by_server, grpc_stalled, http_stalled

WRITE_TIMEOUT_S = 3
MAX_TOKENS = 6000  # far more than the kernels' buffers and the windows absorb
NEIGHBOUR = [5, 17, 99, 3]


@pytest.fixture(scope="module")
def stack(long_models, tmp_path_factory):
    cluster = Cluster(long_models[2], tmp_path_factory.mktemp("backpressure"), http=True,
                      orchestrator_args=("--stream-write-timeout", str(WRITE_TIMEOUT_S)))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def held(cluster: Cluster) -> dict[str, float]:
    out = {name: cluster.metric(name, "specdecode_kv_cache_sequences")
           for name in [*cluster.scorers, *cluster.proposers]}
    out["running"] = cluster.metric("orchestrator", "specdecode_running_sequences")
    return out


def neighbour(address: str, max_tokens: int) -> list[int]:
    with SpecDecodeClient(address) as client:
        return [t for r in client.stream(NEIGHBOUR, max_tokens=max_tokens) for t in r.token_ids]


def test_clients_that_never_read_are_paused_then_cancelled_and_released(stack, long_models):
    address, metric = stack.address("orchestrator"), stack.metric
    socks = [http_stalled(stack.http_port, [i + 1, 2, 3], MAX_TOKENS) for i in range(3)]
    calls = [grpc_stalled(address, [i + 7, 8], MAX_TOKENS) for i in range(2)]
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reading = pool.submit(neighbour, address, 300)
            stack.wait_for(lambda: metric("orchestrator", "specdecode_paused_sequences") >= 1,
                           120, "a never-read stream paused")
            stack.wait_for(lambda: metric("orchestrator",
                                          "specdecode_stream_write_timeouts_total") == 5,
                           120, "5 never-read streams cancelled")
            assert metric("orchestrator", "specdecode_stream_write_timeouts_total",
                          'api="http"') == 3
            tokens = reading.result(300)
        assert tokens == reference_greedy(long_models[0], NEIGHBOUR, 300)
        stack.wait_for(lambda: set(held(stack).values()) == {0}, 30,
                       "every sequence released on both services")
        assert metric("orchestrator", "specdecode_paused_sequences") == 0
        assert all(closed_by_server(s) for s in socks), "the server closed every connection"
        for _, call in calls:
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:  # what was written before, then the status
                    pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "took no output" in err.value.details()
        generated = metric("orchestrator", "specdecode_generation_tokens_total")
        assert generated < 5 * MAX_TOKENS / 2, generated  # stopped long before max_tokens
    finally:
        for s in socks:
            s.close()
        for channel, _ in calls:
            channel.close()
    print(f"\n5 never-read streams paused and cancelled; {generated:.0f} tokens generated "
          f"in all (neighbour 300)")


def test_a_client_that_reads_within_the_write_timeout_is_never_cut(stack):
    """The window watch (orchestrator.frontend.client_window) cuts a client whose advertised
    window has stayed short of its widest for a write timeout: it must not cut one that
    reads. A client on the kernel's default buffers reading every second (within the
    timeout, its window short of its widest between reads) ends its stream whole, while
    beside it a silent one on a small fixed buffer is cut, the one write timeout counted.
    The silent one is not read until then: reading it (closed_by_server) makes it a reader,
    and in CI, not cut while the slow one read, it took its whole stream and was closed as
    an idle keep-alive connection, uncounted. A silent client on default buffers is not
    asserted: Linux grows a non-reader's buffer under small segments and keeps its window
    open (docs/design.md, *Back-pressure*)."""
    metric = stack.metric
    before = metric("orchestrator", "specdecode_stream_write_timeouts_total", 'api="http"')
    silent = http_stalled(stack.http_port, [4, 2, 3], MAX_TOKENS, logprobs=0)
    slow = http_stalled(stack.http_port, [5, 2, 3], 400, logprobs=0, receive_buffer=None)
    try:
        body, chunk = b"", b"-"
        while chunk and b"data: [DONE]" not in body:  # a second's reads, each taking all there is
            time.sleep(1.0)
            slow.settimeout(5.0)
            chunk = slow.recv(1 << 20)
            body += chunk
        assert re.search(rb'"finish_reason": ?"length"', body), "the slow reader's stream ended whole"
        stack.wait_for(lambda: metric("orchestrator", "specdecode_stream_write_timeouts_total",
                                      'api="http"') >= before + 1, 120, "the silent client cut")
        assert closed_by_server(silent, 30), "the silent client was closed"
        assert metric("orchestrator", "specdecode_stream_write_timeouts_total",
                      'api="http"') == before + 1
    finally:
        silent.close()
        slow.close()
