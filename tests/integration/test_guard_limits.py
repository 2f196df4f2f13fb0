"""Issue 11's table, replayed over real processes: every oversized or hostile input gets a
clear status naming the field or limit, fast, while another user's stream goes on; and a
fuzz run of malformed messages against all three services."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdecode.api.client import SpecDecodeClient, build_request
from specdecode.wire import codec
from specdecode.interfaces import SpeculativeProposals
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)
from specdecode.v1 import (model_info_pb2, proposer_service_pb2, scorer_service_pb2,
                           sequence_pb2, tensor_pb2)
from specdecode_stack.local import LocalStack, StackConfig, free_port
from tests.integration.fuzzing import mutate_bytes
from tests.support.references import reference_greedy

STREAM_PROMPT, STREAM_TOKENS = [11, 22, 33, 44, 55], 200
SCORE = "/specdecode.v1.ScorerService/ScoreProposals"
PROPOSE = "/specdecode.v1.ProposerService/GetProposals"
GENERATE = "/specdecode.v1.SpecDecodeService/Generate"


@pytest.fixture(scope="module")
def stack(tiny_model_dirs):
    config = StackConfig(target_model=tiny_model_dirs["target"],
                         draft_model=tiny_model_dirs["draft"], tokenizer="none", device="cpu",
                         num_speculative_tokens=3, port=0, http_port=free_port(),
                         orchestrator_args=["--max-running-requests", "2",
                                            "--max-queued-requests", "1"])
    with LocalStack(config) as s:
        yield s


def step_request(n_seqs: int, length: int, k: int, first_id: int = 10_000,
                 output: int = 1) -> sequence_pb2.ExecuteModelRequest:
    gen = torch.Generator().manual_seed(n_seqs * 7 + length)
    groups = [SequenceGroupMetadata(
        request_id=f"r{i}", is_prompt=output == 0,
        seq_data={first_id + i: SequenceData(
            torch.randint(0, 256, (length - output,), generator=gen).tolist(), [7] * output)},
        sampling_params=SamplingParams(max_tokens=8)) for i in range(n_seqs)]
    return codec.request_to_proto(ExecuteModelRequest(groups, num_lookahead_slots=k))


def score_request(n_seqs: int, length: int, k: int, **kw) -> scorer_service_pb2.ScoreProposalsRequest:
    proposals = SpeculativeProposals(proposal_token_ids=torch.full((n_seqs, k), 3),
                                     proposal_probs=None,
                                     proposal_lens=torch.full((n_seqs,), k))
    return scorer_service_pb2.ScoreProposalsRequest(
        request=step_request(n_seqs, length, k, **kw),
        proposals=codec.proposals_to_proto(proposals))


def call(channel: grpc.Channel, method: str, message, timeout: float = 10.0,
         stream: bool = False) -> tuple[grpc.StatusCode, str, float]:
    """Send a message (or raw bytes); (status, details, seconds)."""
    raw = message if isinstance(message, bytes) else message.SerializeToString()
    start = time.perf_counter()
    try:
        if stream:
            for _ in channel.unary_stream(method)(raw, timeout=timeout):
                pass
        else:
            channel.unary_unary(method)(raw, timeout=timeout)
        return grpc.StatusCode.OK, "", time.perf_counter() - start
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", time.perf_counter() - start


def peak_rss_mb(stack: LocalStack, role: str) -> float:
    status = open(f"/proc/{stack.processes[role].pid}/status").read()
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("VmHWM"))) / 1024


def metric(stack: LocalStack, role: str, name: str) -> float:
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{stack.metrics_ports[role]}/metrics").read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name) and not line.startswith("#"))


class Stream:
    """Another user's stream, with the arrival time of every response."""

    def __init__(self, address: str):
        self.client, self.times, self.tokens = SpecDecodeClient(address), [], []
        self.thread = threading.Thread(target=self._run)

    def _run(self):
        for response in self.client.stream(STREAM_PROMPT, max_tokens=STREAM_TOKENS):
            self.times.append(time.perf_counter())
            self.tokens += response.token_ids

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times[3:], self.times[4:])]


def test_issue_table_rows_get_clear_statuses_fast(stack, target_model):
    want = reference_greedy(target_model, STREAM_PROMPT, STREAM_TOKENS)
    baseline = Stream(stack.address)
    baseline.thread.start()
    baseline.thread.join()
    assert baseline.tokens == want
    scorer_rss0, orchestrator_rss0 = peak_rss_mb(stack, "scorer"), peak_rss_mb(stack, "orchestrator")
    stopped0 = metric(stack, "scorer", "specdecode_model_calls_stopped_total")

    public = grpc.insecure_channel(stack.address)
    scorer = grpc.insecure_channel(stack.service_addresses["scorer"])
    huge = score_request(1, 8, 2)  # a ~100-byte call whose probs claim [1, 2, 2^31]
    huge.proposals.proposal_probs.CopyFrom(tensor_pb2.Tensor(
        dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1, 2, 2**31],
        sparse_rows=tensor_pb2.SparseRows(row_starts=bytes(24))))

    def generate(prompt, **params):
        return build_request(prompt, **params)

    rows = [  # (what, channel, method, message, status, text the details must contain)
        ("tensor claiming [1, 2, 2^31]", scorer, SCORE, huge,
         grpc.StatusCode.INVALID_ARGUMENT, "proposals.proposal_probs: shape [1, 2, 2147483648]"),
        ("8,000-token prompt", public, GENERATE, generate([1] * 8000, max_tokens=4),
         grpc.StatusCode.INVALID_ARGUMENT, "prompt: 8000 tokens; the limit is 255"),
        ("10 MB text prompt", public, GENERATE, generate("x" * 10_000_000),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
        ("60 MB token-id prompt", public, GENERATE, generate([2**62] * 6_000_000),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
        ("64 x 4,000-token batch to the scorer", scorer, SCORE, score_request(64, 4000, 1),
         grpc.StatusCode.INVALID_ARGUMENT, "(--max-batch-tokens)"),
        ("k = 4,000 to the scorer", scorer, SCORE, score_request(1, 8, 4000),
         grpc.StatusCode.INVALID_ARGUMENT, "request.num_lookahead_slots: 4000; at most 16"),
        ("num_speculative_tokens=16 on a k=3 server", public, GENERATE,
         generate([1, 2], num_speculative_tokens=16), grpc.StatusCode.INVALID_ARGUMENT,
         "num_speculative_tokens: must be in [0, 3]"),
        ("temperature=+inf", public, GENERATE, generate([1, 2], temperature=float("inf")),
         grpc.StatusCode.INVALID_ARGUMENT, "temperature: must be a finite number"),
        ("max_tokens=10^9", public, GENERATE, generate([1, 2], max_tokens=10**9),
         grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: 1000000000 does not fit"),
        ('stop=[""]', public, GENERATE, generate([1, 2], stop=[""]),
         grpc.StatusCode.INVALID_ARGUMENT, "stop[0]: must have 1 to 256 characters"),
        ("1 MB request_id", public, GENERATE, generate([1, 2], request_id="i" * 1_000_000),
         grpc.StatusCode.INVALID_ARGUMENT, "request_id: 1000000 characters; at most 128"),
        ("undecodable bytes", scorer, SCORE, b"\xff" * 50,
         grpc.StatusCode.INVALID_ARGUMENT, "request: not a valid ScoreProposals request"),
    ]
    stream = Stream(stack.address)
    stream.thread.start()
    while len(stream.times) < 5:
        time.sleep(0.01)
    report = []
    for what, channel, method, message, status, text in rows:
        code, details, seconds = call(channel, method, message, stream=method == GENERATE)
        report.append(f"{what}: {code.name} in {seconds * 1e3:.0f} ms: {details[:90]}")
        assert (code, text in details) == (status, True), report[-1]
        # Refused at the door, not after a 10 s deadline; the bound is generous because
        # handing 54 MB to a loaded loopback took 1.07 s in CI (RSS below is the real check).
        assert seconds < 5.0, report[-1]
    scorer_rss_rows, orchestrator_rss_rows = (peak_rss_mb(stack, "scorer"),
                                              peak_rss_mb(stack, "orchestrator"))
    # A forward whose caller is gone is stopped, and the next call is not queued behind it.
    heavy = score_request(256, 255, 0, first_id=50_000, output=0)  # 65,280 new tokens
    code, _, _ = call(scorer, SCORE, heavy, timeout=0.3)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    code, details, seconds = call(scorer, SCORE, score_request(1, 8, 2))
    assert code == grpc.StatusCode.OK, details
    report.append(f"timed-out 65k-token forward, then a small call: OK in {seconds * 1e3:.0f} ms")
    stream.thread.join()
    assert stream.tokens == want  # the neighbour's stream was unharmed
    assert metric(stack, "scorer", "specdecode_model_calls_stopped_total") > stopped0
    scorer_rss1 = peak_rss_mb(stack, "scorer")
    base, during = statistics.median(baseline.gaps()), statistics.median(stream.gaps())
    report.append(f"neighbour's stream: median gap {base * 1e3:.1f} ms alone, {during * 1e3:.1f} "
                  f"ms during the rows (largest {max(stream.gaps()) * 1e3:.0f} ms); scorer peak "
                  f"RSS {scorer_rss0:.0f} MB before, {scorer_rss_rows:.0f} MB after the rows, "
                  f"{scorer_rss1:.0f} MB after the stopped 65k-token forward; orchestrator peak "
                  f"RSS {orchestrator_rss0:.0f} MB before, {orchestrator_rss_rows:.0f} MB after "
                  f"the rows")
    print("\n".join(report))
    # The [1, 2, 2^31] claim alone grew the scorer to 17 GB before; the rows now cost
    # nothing, and the stopped forward (65k tokens through the model) stays well under 1 GB.
    assert scorer_rss_rows - scorer_rss0 < 64, report[-1]
    assert orchestrator_rss_rows - orchestrator_rss0 < 256, report[-1]  # 2.8 GB before
    assert scorer_rss1 - scorer_rss0 < 512, report[-1]
    if os.environ.get("SPECDECODE_STRICT_TIMING", "1") != "0":  # see test_chunked_prefill
        assert during < 2 * base, report[-1]


def test_full_queue_answers_with_a_retry_hint_on_both_apis(stack, target_model):
    """--max-running-requests 2 --max-queued-requests 1, one admission for both APIs: with
    two streams running and one queued, a fourth request is refused at once, over gRPC with
    RESOURCE_EXHAUSTED and a retry-after-ms trailer, over HTTP with 429, Retry-After and
    retry-after-ms. The scorer is paused (SIGSTOP) before the three are sent, so none can
    finish before the fourth arrives however fast the machine; afterwards they finish exact.
    Every call has a deadline: a request admitted by mistake fails the test, it cannot hang."""
    clients = [SpecDecodeClient(stack.address, timeout_s=60) for _ in range(4)]
    scorer = stack.processes["scorer"]
    http = f"http://127.0.0.1:{stack.config.http_port}/v1"
    inside = lambda: (metric(stack, "orchestrator", "specdecode_running_sequences")  # noqa: E731
                      + metric(stack, "orchestrator", "specdecode_waiting_requests"))
    deadline = time.monotonic() + 60  # an earlier test's stream may still be finishing
    while inside() > 0:
        assert time.monotonic() < deadline, f"{inside()} requests still inside after 60 s"
        time.sleep(0.05)
    try:
        os.kill(scorer.pid, signal.SIGSTOP)
        try:
            held = [c.stream(STREAM_PROMPT, max_tokens=100) for c in clients[:3]]
            deadline = time.monotonic() + 30
            while inside() < 3:  # all three admitted: two running, one waiting for a slot
                assert time.monotonic() < deadline, f"{inside()} of 3 requests admitted in 30 s"
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as err:
                next(clients[3].stream([1, 2, 3], max_tokens=2))
            with openai.OpenAI(base_url=http, api_key="none", max_retries=0,
                               timeout=30) as oa, \
                    pytest.raises(openai.RateLimitError) as refused:
                oa.completions.create(model="", prompt=[1, 2, 3], max_tokens=2)
        finally:
            os.kill(scorer.pid, signal.SIGCONT)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        assert "--max-queued-requests" in err.value.details()
        assert int(dict(err.value.trailing_metadata())["retry-after-ms"]) >= 1000
        response = refused.value.response
        assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
        assert int(response.headers["retry-after-ms"]) >= 1000
        assert "--max-queued-requests" in response.json()["error"]["message"]
        want = reference_greedy(target_model, STREAM_PROMPT, 100)
        for s in held:
            assert [t for r in s for t in r.token_ids] == want
    finally:
        for c in clients:
            c.close()


def test_a_non_streamed_http_request_is_cancelled_when_its_client_leaves(stack):
    """Uvicorn does not cancel a handler whose client went away: a non-streamed completion
    ran to max_tokens for no one, holding its admission slot. With the scorer paused (so the
    request cannot finish), a client sends one and disconnects: the orchestrator cancels it
    while the scorer is still paused, and its slot is free again."""
    def cancelled() -> float:
        body = urllib.request.urlopen(
            f"http://127.0.0.1:{stack.metrics_ports['orchestrator']}/metrics").read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith("specdecode_requests_total{")
                   and 'outcome="cancelled"' in line)

    scorer, before = stack.processes["scorer"], cancelled()
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 100}).encode()
    os.kill(scorer.pid, signal.SIGSTOP)
    try:
        with socket.create_connection(("127.0.0.1", stack.config.http_port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + 30
            while metric(stack, "orchestrator", "specdecode_running_sequences") + \
                    metric(stack, "orchestrator", "specdecode_waiting_requests") < 1:
                assert time.monotonic() < deadline, "the request was not admitted in 30 s"
                time.sleep(0.05)
        deadline = time.monotonic() + 10  # the server polls for a disconnect every 0.25 s
        while cancelled() == before:
            assert time.monotonic() < deadline, "not cancelled within 10 s of the disconnect"
            time.sleep(0.05)
    finally:
        os.kill(scorer.pid, signal.SIGCONT)
    assert cancelled() == before + 1


def test_http_api_applies_the_grpc_limits(stack):
    """The OpenAI API goes through the same limits (orchestrator.frontend.generation.Frontend): the
    issue's rows, sent as JSON, get 400 naming the field, or 413 for a body over the size
    the limits need; the real `openai` client sees OpenAI's error shape."""
    base = f"http://127.0.0.1:{stack.config.http_port}/v1"
    with openai.OpenAI(base_url=base, api_key="none", max_retries=0) as oa:
        for kwargs, param, text in [
            ({"prompt": [1] * 8000}, "prompt", "prompt: 8000 tokens; the limit is 255"),
            ({"prompt": [1, 2], "max_tokens": 10**9}, "max_tokens",
             "max_tokens: 1000000000 does not fit"),
            ({"prompt": [1, 2], "stop": [""]}, "stop[0]", "must have 1 to 256 characters"),
            ({"prompt": [1, 2], "stop": ["x"] * 17}, "stop", "17 strings; at most 16"),
            ({"prompt": [1, 2], "extra_body": {"num_speculative_tokens": 16}},
             "num_speculative_tokens", "must be in [0, 3]"),
        ]:
            with pytest.raises(openai.BadRequestError) as err:
                oa.completions.create(model="", **{"max_tokens": 2, **kwargs})
            error = err.value.body
            assert (err.value.status_code, error["param"]) == (400, param), error
            assert text in error["message"], error
    # JSON has no infinity, but Python's parser reads one: refused like gRPC's +inf.
    status, error = post(base, b'{"prompt": [1, 2], "temperature": Infinity}')
    assert (status, error["error"]["param"]) == (400, "temperature"), error
    start = time.perf_counter()  # 10 MB, announced (refused from its Content-Length) or chunked
    status, error = raw_post(stack.config.http_port, 10_000_000, [b'{"prompt": "'])
    assert status == 413 and "request body: 10000000 bytes" in error["error"]["message"], error
    status, error = raw_post(stack.config.http_port, None,
                             [b'{"prompt": "'] + [b"x" * 1_000_000] * 10)
    assert status == 413 and "request body: more than" in error["error"]["message"], error
    assert time.perf_counter() - start < 5.0
    status, ok = post(base, json.dumps({"prompt": [1, 2, 3], "max_tokens": 3}).encode())
    assert status == 200, ok


def raw_post(port: int, length: int | None, parts: list[bytes]) -> tuple[int, dict]:
    """POST /v1/completions over a socket: Content-Length `length` (None: chunked), then
    `parts` until the server stops reading; (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        framing = b"Transfer-Encoding: chunked" if length is None else \
            f"Content-Length: {length}".encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                     b"Content-Type: application/json\r\n" + framing + b"\r\n\r\n")
        for part in parts:
            try:
                sock.sendall(part if length is not None else
                             b"%x\r\n%s\r\n" % (len(part), part))
            except OSError:  # the server answered and closed
                break
        response = b""
        while b"\r\n\r\n" not in response or len(response.split(b"\r\n\r\n", 1)[1]) < \
                int(response.lower().split(b"content-length: ", 1)[1].split(b"\r\n")[0]):
            chunk = sock.recv(65536)
            if not chunk:
                break
            response += chunk
    head, body = response.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def post(base: str, body) -> tuple[int, dict]:
    """POST /completions with raw bytes; (status, JSON body)."""
    request = urllib.request.Request(f"{base}/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- fuzzing -------------------------------------------------------------------------------

def _seeds() -> dict[str, tuple[bytes, bool]]:
    """Valid messages per method (bytes, server-streaming?)."""
    step = step_request(2, 6, 2)
    return {
        GENERATE: (build_request([5, 6, 7], max_tokens=2).SerializeToString(), True),
        PROPOSE: (proposer_service_pb2.GetProposalsRequest(request=step).SerializeToString(), False),
        SCORE: (score_request(2, 6, 2).SerializeToString(), False),
        "/specdecode.v1.ScorerService/GetModelInfo":
            (model_info_pb2.GetModelInfoRequest().SerializeToString(), False),
        "/specdecode.v1.ProposerService/ReleaseSequences":
            (model_info_pb2.ReleaseSequencesRequest(seq_ids=[1, 2]).SerializeToString(), False),
        "/specdecode.v1.ScorerService/ReleaseSequences":
            (model_info_pb2.ReleaseSequencesRequest(seq_ids=[3]).SerializeToString(), False),
    }


ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION}


def test_fuzz_all_three_services(stack, target_model):
    """1,200 random and mutated messages (fixed seed), many per connection: no UNKNOWN or
    INTERNAL, no crash, servers healthy and exact after, and malformed ones counted."""
    rng = random.Random(11)
    seeds = _seeds()
    roles = {GENERATE: "orchestrator"}
    channels = {role: grpc.insecure_channel(addr) for role, addr in stack.service_addresses.items()}
    seen: dict[str, int] = {}
    methods = list(seeds)
    others = [m for m, _ in seeds.values()]
    for i in range(1200):
        method = methods[i % len(methods)]
        role = roles.get(method, "scorer" if "Scorer" in method else "proposer")
        data, streaming = seeds[method]
        code, details, _ = call(channels[role], method, mutate_bytes(rng, data, others),
                                timeout=3.0, stream=streaming)
        seen[code.name] = seen.get(code.name, 0) + 1
        assert code in ALLOWED, (i, method, code, details)
    print("fuzz statuses:", seen)
    for role, proc in stack.processes.items():
        assert proc.poll() is None, role
        stub = health_pb2_grpc.HealthStub(channels[role])
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert metric(stack, role, "specdecode_malformed_requests_total") > 0, role
    with SpecDecodeClient(stack.address) as client:
        assert client.generate([5, 17, 99, 3], max_tokens=8).token_ids == \
            reference_greedy(target_model, [5, 17, 99, 3], 8)
