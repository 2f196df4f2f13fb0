"""The OpenTelemetry GenAI conventions as a real OTLP receiver gets them from a real stack
(tests/integration/conftest.py: SmolLM2 target, `--served-model-name smol`): chat requests'
span is `chat smol` with gen_ai.operation.name chat, completions' `text_completion smol`,
each under FastAPI's HTTP server span; the gen_ai.server.* histograms arrive as OTLP
metrics, error.type on a request its client cancelled."""

from __future__ import annotations

import time

import openai
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.otlp import Receiver, Span, attrs, spans_of
from tests.support.smol_stack import SERVED

CHAT = [{"role": "user", "content": "Name a colour."}]
PROMPT = "for i in range(3):\n    print(i)\nfor i in range(3):\n"
SERVER = trace_pb2.Span.SPAN_KIND_SERVER
COMMON = {"gen_ai.provider.name": "specdecode", "gen_ai.request.model": SERVED,
          "gen_ai.response.model": SERVED}


@pytest.fixture(scope="module")
def client(smol_stack):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{smol_stack.config.http_port}/v1",
                       api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def wait_for(find, timeout_s: float = 120.0):
    """find()'s first truthy answer, polled while the exporters push (every 0.1-1 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = find()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"not exported within {timeout_s:.0f}s")


def request_span(otlp: Receiver, request_id: str) -> tuple[Span, list[Span]]:
    """The request span whose specdecode.request_id is `request_id`, and all spans, once its
    trace's root has arrived too (the HTTP server span ends after the response, so it may be
    exported in a later batch)."""
    def find():
        spans = spans_of(otlp)
        mine = [s for s in spans if s.attributes.get("specdecode.request_id") == request_id]
        if not mine:
            return None
        chain = [mine[0], *ancestors(mine[0], spans)]
        return (mine[0], spans) if not chain[-1].parent else None
    return wait_for(find)


def ancestors(span: Span, spans: list[Span]) -> list[Span]:
    by_id, chain = {s.span_id: s for s in spans}, []
    while span.parent in by_id:
        span = by_id[span.parent]
        chain.append(span)
    return chain


def duration_points(otlp: Receiver, operation: str, name="gen_ai.server.request.duration"):
    """The last exported points of a gen_ai.server.* histogram for one operation."""
    last = []
    for request in otlp.metrics:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == name:
                        last = [p for p in metric.histogram.data_points
                                if attrs(p)["gen_ai.operation.name"] == operation]
    return last


def test_a_chat_request_is_a_chat_span_under_the_http_server_span(client, otlp):
    done = client.chat.completions.with_raw_response.create(
        model=SERVED, messages=CHAT, max_tokens=4, temperature=0,
        extra_headers={"X-Request-Id": "genai-chat-1"})
    assert done.parse().id == "chatcmpl-genai-chat-1"
    span, spans = request_span(otlp, "genai-chat-1")
    assert span.name == f"chat {SERVED}"
    a = span.attributes
    assert {k: a[k] for k in COMMON} == COMMON and a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.response.id"] == "chatcmpl-genai-chat-1"
    assert a["gen_ai.request.stream"] is False and a["gen_ai.output.type"] == "text"
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.usage.input_tokens"] == done.parse().usage.prompt_tokens
    assert "gen_ai.request.choice.count" not in a and "error.type" not in a
    server = ancestors(span, spans)[-1]  # the trace's root: FastAPI's HTTP server span
    assert server.kind == SERVER and server.name == "POST /v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 200


def test_a_streamed_completion_of_two_choices(client, otlp):
    chunks = list(client.completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=3, n=2, temperature=0.7, seed=5, stop=["\n\n"],
        stream=True, extra_headers={"X-Request-Id": "genai-cmpl-1"}))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    span, _ = request_span(otlp, "genai-cmpl-1")
    a = span.attributes
    assert span.name == f"text_completion {SERVED}"
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.stream"] is True
    assert a["gen_ai.request.choice.count"] == 2 and a["gen_ai.request.seed"] == 5
    assert a["gen_ai.request.stop_sequences"] == ["\n\n"]
    assert a["gen_ai.response.id"] == "cmpl-genai-cmpl-1"
    assert len(a["gen_ai.response.finish_reasons"]) == 2


def test_a_cancelled_stream_has_an_error_type(client, otlp):
    stream = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=200,
                                       stream=True, extra_headers={"X-Request-Id": "genai-gone"})
    next(iter(stream))
    stream.close()  # the client goes away
    span, _ = request_span(otlp, "genai-gone")
    assert span.attributes["error.type"] == "cancelled"
    assert span.attributes["specdecode.finish_reason"] == "cancelled"


def test_the_server_histograms_arrive_as_otlp_metrics(client, otlp):
    client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=3)
    for name in ("gen_ai.server.request.duration", "gen_ai.server.time_to_first_token",
                 "gen_ai.server.time_per_output_token"):
        points = wait_for(lambda: [p for p in duration_points(otlp, "chat", name)
                                   if "error.type" not in attrs(p)])
        (point,) = points
        assert attrs(point) == {**COMMON, "gen_ai.operation.name": "chat"}, name
        assert point.count >= 1 and point.sum > 0
    # The cancelled stream: a duration with its error.type, no time to first token.
    failed = wait_for(lambda: [p for p in duration_points(otlp, "text_completion")
                               if attrs(p).get("error.type") == "cancelled"])
    assert failed[0].count >= 1
    assert not [p for p in duration_points(otlp, "text_completion",
                                           "gen_ai.server.time_to_first_token")
                if "error.type" in attrs(p)]
