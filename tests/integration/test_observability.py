"""Traces, metrics and logs of the three services as real processes, exported to a real OTLP
gRPC receiver on loopback and scraped from their /metrics endpoints."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
import torch
from opentelemetry.proto.trace.v1 import trace_pb2

from specdecode.wire import codec
from specdecode.api.client import GenerateResult, SpecDecodeClient, accumulate, build_request
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)
from specdecode.v1 import proposer_service_pb2, proposer_service_pb2_grpc
from specdecode_stack.local import LocalStack, StackConfig, free_port, wait_process_serving
from tests.otlp import Receiver, Span, attrs, spans_of
from tests.support.metrics import scrape_metrics
from tests.support.paths import ROOT

PROMPT = [5, 17, 99, 3]
MAX_TOKENS = 24
K = 3
SERVER, CLIENT = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT
REQUEST_SPAN = "text_completion target"  # GenAI: {operation} {model}; gRPC Generate


def model_names(port: int) -> set[str]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return set(re.findall(r'model_name="([^"]*)"', body))


@dataclass
class Run:
    result: object
    spans: list[Span]
    metrics: dict[str, dict[str, float]]  # role -> scraped samples
    otlp_metrics: list
    exit_codes: dict
    model_names: dict[str, set[str]]  # role -> model_name label values on its /metrics

    def named(self, name: str, service: str | None = None) -> list[Span]:
        return [s for s in self.spans if s.name == name and service in (None, s.service)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, target_model):
    """The tiny target, and a draft that is the target with a noisy head: it agrees with the
    target often but not always (36 draft tokens, 18 accepted on PROMPT)."""
    root = tmp_path_factory.mktemp("obs-models")
    draft = copy.deepcopy(target_model)
    with torch.no_grad():
        head = draft.lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0))
                  * 0.5 * head.std())
    target_model.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return {"target": str(root / "target"), "draft": str(root / "draft")}


def generate(client: SpecDecodeClient, traceparent: str | None = None, **params):
    """One Generate, optionally as part of the caller's trace (W3C traceparent)."""
    result = GenerateResult()
    metadata = [("traceparent", traceparent)] if traceparent else None
    params = {"max_tokens": MAX_TOKENS, **params}
    for response in client.stub.Generate(build_request(PROMPT, **params),
                                         metadata=metadata, timeout=120):
        accumulate(result, response)
    return result


# The GenAI conventions' advisory bucket boundaries (semantic-conventions, gen-ai-metrics).
BOUNDS = {
    "gen_ai.server.request.duration": [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                                       5.12, 10.24, 20.48, 40.96, 81.92],
    "gen_ai.server.time_to_first_token": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                          0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0],
    "gen_ai.server.time_per_output_token": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                                            0.5, 0.75, 1.0, 2.5],
}


def genai_histograms(otlp_metrics: list) -> dict[str, list]:
    """The gen_ai.server.* histograms' points in the orchestrator's last export that has them."""
    last = {}
    for request in otlp_metrics:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name.startswith("gen_ai."):
                        last[metric.name] = list(metric.histogram.data_points)
    return last


def run_once(model_dirs, scoring: str = "batch-expansion", traceparent: str | None = None,
             unsampled_too: bool = False, refuse_http: bool = False, **env) -> Run:
    """Start the stack exporting to a fresh receiver, run one Generate (and, with
    `unsampled_too`, a second one whose caller does not sample it; with `refuse_http`, one
    HTTP request the API refuses), scrape, stop."""
    receiver = Receiver()
    stack = LocalStack(StackConfig(
        target_model=model_dirs["target"], draft_model=model_dirs["draft"], tokenizer="none",
        device="cpu", scoring=scoring, num_speculative_tokens=K, speculation="fixed", port=0,
        http_port=free_port(),
        draft_confidence=0.0,  # every proposal K long: the counts below follow from it
        extra_env={**receiver.env, **env}))
    try:
        stack.start()
        with SpecDecodeClient(stack.address) as client:
            result = generate(client, traceparent, request_id="obs-1")
            if unsampled_too:
                untraced = f"00-{'ab' * 16}-{'cd' * 8}-00"
                unsampled = generate(client, untraced, request_id="obs-2")
                assert unsampled.token_ids == result.token_ids
                with pytest.raises(grpc.RpcError) as err:  # bad input, counted by its code
                    generate(client, untraced, max_tokens=-1)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        if refuse_http:  # the HTTP requests' metrics get a sample
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"http://127.0.0.1:{stack.config.http_port}/v1/models/x")
            assert refused.value.code == 404
            wait_http_counted(stack.metrics_ports.values())
        metrics = {role: scrape_metrics(port) for role, port in stack.metrics_ports.items()}
        names = {role: model_names(port) for role, port in stack.metrics_ports.items()}
    finally:
        codes = stack.stop()
        receiver.server.stop(None)
    return Run(result, spans_of(receiver), metrics, receiver.metrics, codes, names)


def wait_http_counted(ports, timeout_s: float = 10.0) -> None:
    """Until a /metrics endpoint counts an HTTP request: the middleware counts one after its
    response's last message is sent, so a client can read the 404 first, and a scrape right
    after it missed the sample with two busy loops beside the suite."""
    deadline = time.monotonic() + timeout_s
    while not any(key.startswith("specdecode_http_requests_total")
                  for port in ports for key in scrape_metrics(port)):
        assert time.monotonic() < deadline, "no HTTP request counted"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def run(model_dirs) -> Run:
    return run_once(model_dirs, refuse_http=True)


# -- traces ---------------------------------------------------------------------------------

def test_stack_exits_cleanly_and_flushes(run):
    assert run.exit_codes == {"orchestrator": 0, "proposer": 0, "scorer": 0}
    assert run.result.finish_reason == "length" and len(run.result.token_ids) == MAX_TOKENS
    assert run.result.usage.accepted_tokens > 0  # a run that exercises acceptance


def test_one_generate_is_one_trace(run):
    # The refused HTTP request is a trace of its own (FastAPI's server span, no request span).
    (http,) = run.named("GET /v1/models/{model_id}")
    assert {s.trace_id for s in run.spans} - {http.trace_id} == \
        {run.named(REQUEST_SPAN)[0].trace_id}
    assert len(run.named(REQUEST_SPAN)) == 1


def test_service_names_differ(run):
    by_service = {s.service for s in run.spans}
    assert by_service == {"specdecode-orchestrator", "specdecode-proposer", "specdecode-scorer"}
    assert {s.service for s in run.named("draft_model.forward")} == {"specdecode-proposer"}
    assert {s.service for s in run.named("target_model.forward")} == {"specdecode-scorer"}


@pytest.mark.parametrize("service,method,role", [
    ("ProposerService", "GetProposals", "proposer"), ("ScorerService", "ScoreProposals", "scorer")])
def test_client_spans_parent_the_services_server_spans(run, service, method, role):
    name = f"specdecode.v1.{service}/{method}"
    clients = [s for s in run.named(name, "specdecode-orchestrator") if s.kind == CLIENT]
    servers = [s for s in run.named(name, f"specdecode-{role}") if s.kind == SERVER]
    steps = run.named("spec_decode.step")
    assert len(steps) == run.result.usage.steps
    # The prompt step has nothing to propose (k = 0), so it makes no proposer call.
    calls = len(steps) - 1 if role == "proposer" else len(steps)
    assert len(clients) == len(servers) == calls
    assert {s.parent for s in servers} == {c.span_id for c in clients}
    parent_phase = {s.span_id: s for s in run.named("propose" if role == "proposer" else "score")}
    assert all(parent_phase[c.parent].name in ("propose", "score") for c in clients)
    for c in clients:
        assert c.attributes["rpc.system"] == "grpc" and c.attributes["rpc.method"] == method
        assert c.attributes["server.address"] == "127.0.0.1"
        assert isinstance(c.attributes["server.port"], int) and c.attributes["server.port"] > 0
        assert c.attributes["specdecode.wire.bytes_sent"] > 0
        assert c.attributes["rpc.grpc.status_code"] == 0
    for s in servers:
        assert s.attributes["rpc.grpc.status_code"] == 0


def test_span_tree(run):
    ids = {s.span_id: s for s in run.spans}
    (request,) = run.named(REQUEST_SPAN)
    (generate,) = run.named("specdecode.v1.SpecDecodeService/Generate")
    assert generate.kind == SERVER and generate.parent == ""  # the trace's root
    assert request.parent == generate.span_id
    steps = run.named("spec_decode.step")
    assert {s.parent for s in steps} == {request.span_id}
    step_ids = {s.span_id for s in steps}
    for name in ("propose", "score", "rejection_sample"):
        # no propose span on the prompt step: nothing to propose
        assert len(run.named(name)) == len(steps) - (name == "propose")
        assert {s.parent for s in run.named(name)} <= step_ids
    proposer_servers = {s.span_id for s in run.named("specdecode.v1.ProposerService/GetProposals",
                                                     "specdecode-proposer")}
    drafts = run.named("draft_model.forward")
    assert drafts and {s.parent for s in drafts} <= proposer_servers
    assert len(drafts) == run.result.usage.draft_tokens // K * K  # k passes per spec step
    scorer_servers = {s.span_id for s in run.named("specdecode.v1.ScorerService/ScoreProposals",
                                                   "specdecode-scorer")}
    for name in ("batch_expansion.expand", "target_model.forward", "batch_expansion.contract"):
        assert {s.parent for s in run.named(name)} == scorer_servers, name
    for s in run.named("target_model.forward") + drafts:
        assert s.attributes["specdecode.forward.rows"] >= 1
        assert "specdecode.kv_cache.hits" in s.attributes
    assert all(ids[s.parent].service == s.service or s.kind == SERVER for s in run.spans
               if s.parent)


def test_step_attributes_add_up_to_the_usage(run):
    usage = run.result.usage
    steps = run.named("spec_decode.step")
    total = lambda key: sum(s.attributes[f"specdecode.{key}"] for s in steps)  # noqa: E731
    assert len(steps) == usage.steps
    # Steps count vLLM 0.4.2's accepted tokens (passed the test, even after a rejection);
    # the usage counts the accepted prefixes the request received: never more.
    assert total("accepted_tokens") >= usage.accepted_tokens
    assert total("draft_tokens") == usage.draft_tokens
    assert total("emitted_tokens") == usage.emitted_tokens
    assert total("new_tokens") == usage.completion_tokens == MAX_TOKENS
    assert sorted(s.attributes["specdecode.step.index"] for s in steps) == list(range(len(steps)))
    for s in steps:
        k = 0 if s.attributes["specdecode.step.index"] == 0 else K  # the prompt step: none
        assert s.attributes["specdecode.batch_size"] == 1 and s.attributes["specdecode.k"] == k
        assert list(s.attributes["specdecode.chosen_k"]) == [k]
        assert s.attributes["specdecode.wire.bytes_sent"] > 0
        assert s.attributes["specdecode.wire.bytes_received"] > 0
        assert s.attributes["specdecode.request_ids"] == ["obs-1"]
    assert total("wire.bytes_sent") == run.metrics["orchestrator"][
        'specdecode_step_wire_bytes_sum{direction="sent"}']


def test_request_span_attributes(run):
    (request,) = run.named(REQUEST_SPAN)
    usage, a = run.result.usage, request.attributes
    assert a["specdecode.request_id"] == "obs-1"
    assert a["specdecode.prompt_tokens"] == usage.prompt_tokens == len(PROMPT)
    assert a["specdecode.completion_tokens"] == usage.completion_tokens
    assert a["specdecode.accepted_tokens"] == usage.accepted_tokens
    assert a["specdecode.draft_tokens"] == usage.draft_tokens
    assert a["specdecode.acceptance_rate"] == pytest.approx(usage.acceptance_rate)
    assert a["specdecode.finish_reason"] == "length"
    assert a["specdecode.steps"] == usage.steps
    # OpenTelemetry GenAI semantic conventions, exported to the OTLP receiver.
    assert a["gen_ai.operation.name"] == "text_completion"  # gRPC Generate
    assert a["gen_ai.provider.name"] == "specdecode"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "target"  # its directory
    assert a["gen_ai.response.id"] == "obs-1" and a["gen_ai.request.stream"] is True
    assert a["gen_ai.output.type"] == "text"
    assert a["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.top_p"] == 1.0
    assert not {"gen_ai.request.seed", "gen_ai.request.top_k", "gen_ai.request.choice.count",
                "gen_ai.request.stop_sequences", "error.type"} & set(a)  # not asked, no error
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    # The conventions' time metrics are histograms (test_metrics_also_go_over_otlp), not
    # span attributes; the span keeps its time to first token as our own attribute.
    assert not [k for k in a if k.startswith("gen_ai.server.")]
    assert 0 < a["specdecode.time_to_first_token_s"] < 120
    (http,) = run.named("GET /v1/models/{model_id}")  # FastAPI's: its 404 is an error
    assert all(s.status != trace_pb2.Status.STATUS_CODE_ERROR for s in run.spans
               if s.trace_id != http.trace_id)


# -- metrics --------------------------------------------------------------------------------

def test_every_metric_carries_the_model_name(run):
    """scrape_metrics checks that every sample has a model_name label; here, its value."""
    assert run.model_names == {"orchestrator": {"target"}, "scorer": {"target"},
                               "proposer": {"draft"}}


def test_orchestrator_metrics_match_the_run(run):
    m, usage = run.metrics["orchestrator"], run.result.usage
    assert m["specdecode_waiting_requests"] == 0
    assert m["specdecode_draft_tokens_total"] == usage.draft_tokens
    accepted = m["specdecode_accepted_tokens_total"]  # vLLM 0.4.2's meaning
    assert usage.accepted_tokens <= accepted <= usage.draft_tokens
    assert m["specdecode_emitted_tokens_total"] == usage.emitted_tokens
    assert m["specdecode_steps_total"] == usage.steps
    assert m["specdecode_generation_tokens_total"] == usage.completion_tokens
    assert m["specdecode_prompt_tokens_total"] == usage.prompt_tokens
    assert m['specdecode_requests_total{outcome="length"}'] == 1
    assert m["specdecode_draft_acceptance_rate"] == pytest.approx(
        accepted / usage.draft_tokens)
    # vLLM 0.4.2: emitted / (draft_tokens / k speculated sequences x (k + 1)).
    assert m["specdecode_system_efficiency"] == pytest.approx(
        usage.emitted_tokens / (usage.draft_tokens // K * (K + 1)))
    assert 0 < m["specdecode_draft_acceptance_rate"] < 1
    assert m["specdecode_num_spec_tokens"] == K
    by_position = sum(v for k, v in m.items()
                      if k.startswith("specdecode_accepted_tokens_by_position_total"))
    assert by_position == usage.accepted_tokens  # emitted accepted tokens only
    assert m["specdecode_step_duration_seconds_count"] == usage.steps
    for phase in ("propose", "score", "verify", "overhead"):
        assert m[f'specdecode_step_phase_seconds_count{{phase="{phase}"}}'] == usage.steps
    assert m["specdecode_time_to_first_token_seconds_count"] == 1
    assert m["specdecode_e2e_request_latency_seconds_count"] == 1
    assert m["specdecode_running_sequences"] == 0
    assert m['specdecode_rpc_server_duration_seconds_count{code="OK",'
             'method="SpecDecodeService/Generate"}'] == 1


def test_service_metrics_match_the_run(run):
    usage = run.result.usage
    for role, forwards in (("proposer", len(run.named("draft_model.forward"))),
                           ("scorer", len(run.named("target_model.forward")))):
        m = run.metrics[role]
        label = f'{{role="{role}"}}'
        assert m[f"specdecode_model_forward_seconds_count{label}"] == forwards
        assert m[f"specdecode_model_forward_batch_size_count{label}"] == forwards
        assert m[f"specdecode_kv_cache_hits_total{label}"] > 0  # steps after the first reuse KV
        assert m[f"specdecode_kv_cache_misses_total{label}"] >= 1  # the prompt
        assert m[f"specdecode_kv_cache_sequences{label}"] == 0  # released when it finished
        assert m[f"specdecode_kv_cache_occupancy{label}"] == 0
        assert 0 < m[f"specdecode_kv_cache_memory_bytes{label}"] <= 2**31  # the default budget
        assert m[f"specdecode_model_tokens_computed_total{label}"] == \
            m[f"specdecode_model_forward_tokens_sum{label}"]
        assert not any(k.startswith("specdecode_steps") for k in m)  # orchestrator's only
    # batch expansion: one row per continuation, n+1 per speculating sequence
    spec_steps = usage.draft_tokens // K
    rows = run.metrics["scorer"]['specdecode_model_forward_batch_size_sum{role="scorer"}']
    assert rows == spec_steps * (K + 1) + (usage.steps - spec_steps)
    assert run.metrics["proposer"]['specdecode_rpc_server_duration_seconds_count{code="OK",'
                                   'method="ProposerService/GetProposals"}'] == usage.steps - 1


def test_metrics_also_go_over_otlp(run):
    """The same counters reach the OTLP receiver (pushed at least at shutdown), every point
    with the model_name label /metrics has."""
    last: dict[tuple[str, str], float] = {}
    last_model_names: dict[str, set[str]] = {}  # service -> model_name values, last push
    for request in run.otlp_metrics:
        for rm in request.resource_metrics:
            service = attrs(rm.resource)["service.name"]
            bridged = [sm for sm in rm.scope_metrics if sm.scope.name == "specdecode.prometheus"]
            if bridged:
                last_model_names[service] = set()
            for sm in bridged:
                for metric in sm.metrics:
                    points = getattr(metric, metric.WhichOneof("data")).data_points
                    last_model_names[service] |= {attrs(p).get("model_name") for p in points}
                    if metric.HasField("sum"):
                        last[service, metric.name] = sum(p.as_double for p in
                                                         metric.sum.data_points)
    assert last_model_names == {f"specdecode-{role}": names
                                for role, names in run.model_names.items()}
    usage = run.result.usage
    assert last["specdecode-orchestrator", "specdecode_accepted_tokens"] == \
        run.metrics["orchestrator"]["specdecode_accepted_tokens_total"]
    assert last["specdecode-orchestrator", "specdecode_steps"] == usage.steps
    assert last["specdecode-scorer", "specdecode_kv_cache_hits"] > 0
    # The GenAI conventions' server histograms, from the orchestrator: one request each.
    genai = genai_histograms(run.otlp_metrics)
    attributes = {"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "specdecode",
                  "gen_ai.request.model": "target", "gen_ai.response.model": "target"}
    for name in ("gen_ai.server.request.duration", "gen_ai.server.time_to_first_token",
                 "gen_ai.server.time_per_output_token"):
        (point,) = genai[name]
        assert point.count == 1 and point.sum > 0 and attrs(point) == attributes, name
        assert list(point.explicit_bounds) == BOUNDS[name]


# -- step-span sampling ---------------------------------------------------------------------

def test_every_third_step_span_is_kept_and_the_rest_leave_no_trace(run, model_dirs):
    """SPECDECODE_TRACE_STEPS=3 (with multi-query scoring, the other scorer): a third of the
    step spans, and of everything under them in all three services, and nothing else. The
    request continues its caller's trace; a second request its caller does not sample
    leaves no span at all."""
    sampled = run_once(model_dirs, "multi-query", traceparent=TRACEPARENT, unsampled_too=True,
                       SPECDECODE_TRACE_STEPS="3")
    assert sampled.result.token_ids == run.result.token_ids
    assert {s.trace_id for s in sampled.spans} == {TRACE_ID}
    (generate_span,) = sampled.named("specdecode.v1.SpecDecodeService/Generate")
    assert generate_span.parent == TRACEPARENT.split("-")[2]
    assert [s.attributes["specdecode.request_id"] for s in sampled.named(REQUEST_SPAN)] \
        == ["obs-1"]
    steps = sampled.result.usage.steps
    kept = math.ceil(steps / 3)
    assert len(sampled.named("spec_decode.step")) == kept
    assert sorted(s.attributes["specdecode.step.index"] for s in
                  sampled.named("spec_decode.step")) == list(range(0, steps, 3))
    for name in ("propose", "score", "rejection_sample", "multi_query.extend",
                 "target_model.forward", "multi_query.scatter"):
        # step 0 (kept) is the prompt step, which proposes nothing
        assert len(sampled.named(name)) == kept - (name == "propose"), name
    for service, calls in (("ProposerService/GetProposals", kept - 1),
                           ("ScorerService/ScoreProposals", kept)):
        assert len(sampled.named(f"specdecode.v1.{service}")) == 2 * calls  # client + server
    assert len(sampled.spans) < len(run.spans) / 2
    counts = Counter(s.name for s in sampled.spans)
    assert counts["draft_model.forward"] < len(run.named("draft_model.forward"))
    # metrics are not sampled
    m = sampled.metrics["orchestrator"]
    assert m["specdecode_steps_total"] == 2 * steps
    assert m['specdecode_rpc_server_duration_seconds_count{code="OK",'
             'method="SpecDecodeService/Generate"}'] == 2
    assert m['specdecode_rpc_server_duration_seconds_count{code="INVALID_ARGUMENT",'
             'method="SpecDecodeService/Generate"}'] == 1
    assert m['specdecode_requests_total{outcome="invalid"}'] == 1


# -- a process with no OTEL_* configuration -----------------------------------------------------

def serve_ngram_proposer(*flags: str, env: dict[str, str]) -> tuple[str, str]:
    """Run an n-gram proposer, send it one traced GetProposals, stop it: (stdout, stderr)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdecode_stack.cli", "serve", "proposer",
                             "--port", str(port), *flags], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_process_serving(f"127.0.0.1:{port}", 120, proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            group = SequenceGroupMetadata(
                request_id="r", is_prompt=False, seq_data={0: SequenceData([1, 2, 3, 1, 2], [3])},
                sampling_params=SamplingParams(temperature=0.0, max_tokens=8))
            request = proposer_service_pb2.GetProposalsRequest(
                request=codec.request_to_proto(ExecuteModelRequest([group], num_lookahead_slots=2)))
            proposer_service_pb2_grpc.ProposerServiceStub(channel).GetProposals(
                request, metadata=[("traceparent", TRACEPARENT)], timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out, err


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("OTEL_", "SPECDECODE_TRACE", "SPECDECODE_LOG"))}


def test_no_otel_configuration_prints_no_spans_and_logs_json():
    out, err = serve_ngram_proposer(env=clean_env())
    assert out == ""
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert lines and all(line["service"] == "specdecode-proposer" for line in lines)
    assert any(line["message"].startswith("listening on") for line in lines)


def test_a_bad_otel_configuration_is_a_clear_startup_error():
    env = {**clean_env(), "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    out = subprocess.run([sys.executable, "-m", "specdecode_stack.cli", "serve", "proposer",
                          "--port", str(free_port())], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "error: OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json' is not supported" in out.stderr
    assert "Traceback" not in out.stderr


def test_trace_console_prints_the_continued_span():
    out, _ = serve_ngram_proposer("--trace-console", env=clean_env())
    decoder, spans, text = json.JSONDecoder(), [], out.strip()
    while text:
        span, end = decoder.raw_decode(text)
        spans.append(span)
        text = text[end:].strip()
    (span,) = spans
    assert span["name"] == "specdecode.v1.ProposerService/GetProposals"
    assert span["context"]["trace_id"] == "0x" + TRACE_ID
    assert span["parent_id"] == "0x00f067aa0ba902b7"
    assert span["resource"]["attributes"]["service.name"] == "specdecode-proposer"


# -- the dashboard ----------------------------------------------------------------------------

def test_dashboard_queries_only_metrics_the_services_export(run):
    """Every metric a dashboard query names is on some service's /metrics after a run."""
    text = (ROOT / "dashboards" / "specdecode.json").read_text()
    assert text == (ROOT / "helm" / "specdecode" / "dashboards" / "specdecode.json").read_text()
    dashboard = json.loads(text)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs and all(t["datasource"]["uid"] == "${datasource}"
                         for p in dashboard["panels"] for t in p.get("targets", []))
    exported = {re.sub(r"\{.*", "", key) for samples in run.metrics.values() for key in samples}
    named = {name for e in exprs for name in re.findall(r"\bspecdecode_[a-z0-9_]+", e)}
    assert named and not named - exported, sorted(named - exported)
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("acceptance", "efficiency", "tokens / s", "latency", "step time split",
                  "kv cache hit rate"):
        assert topic in titles, topic
