"""What a client or an operator of a vLLM server reaches for, against a real stack (SmolLM2-135M
target, n-gram proposer: tests/integration/conftest.py) with `--served-model-name smol`: the
official `openai` client's models.retrieve, /tokenize -> /detokenize, /version, /ping,
/metrics on the HTTP port (ours and vLLM's names), X-Request-Id, a malformed body answered
in words, and the HTTP requests by route, method and status in Prometheus."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass

import openai
import pytest

from specdecode.api.client import SpecDecodeClient
from tests.support.metrics import scrape_metrics
from tests.support.smol_stack import SERVED

TARGET_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def stack(smol_stack):
    return smol_stack


@dataclass
class Answer:
    status_code: int
    headers: dict[str, str]
    text: str

    def json(self):
        return json.loads(self.text)


class Http:
    """A bare HTTP client (urllib) for the routes outside the openai client's /v1."""

    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"

    def request(self, method: str, path: str, json_body=None, content: bytes | None = None,
                headers: dict[str, str] | None = None) -> Answer:
        if json_body is not None:
            content = json.dumps(json_body).encode()
            headers = {"content-type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.base + path, data=content, method=method,
                                     headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return Answer(r.status, {k.lower(): v for k, v in r.headers.items()},
                              r.read().decode())
        except urllib.error.HTTPError as e:
            return Answer(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode())

    def get(self, path: str, **kw) -> Answer:
        return self.request("GET", path, **kw)

    def post(self, path: str, json=None, **kw) -> Answer:
        return self.request("POST", path, json_body=json, **kw)


@pytest.fixture(scope="module")
def http(stack):
    return Http(stack.config.http_port)


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.http_port}/v1",
                       api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def http_metrics(text: str) -> dict[tuple[str, str, str], float]:
    """(route, method, status) -> specdecode_http_requests_total, from a /metrics body."""
    out = {}
    for labels, v in re.findall(r"^specdecode_http_requests_total\{(.*)\} (\S+)$", text, re.M):
        d = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[d["route"], d["method"], d["status"]] = float(v)
    return out


def test_the_served_name_is_the_models_name_everywhere(stack, client):
    model = client.models.retrieve(SERVED)
    assert model.id == SERVED and model.root == TARGET_FILE
    assert [m.id for m in client.models.list().data] == [SERVED]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve(TARGET_FILE)  # the file's name is not what is served
    assert missing.value.body["param"] == "model"
    done = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=4, temperature=0)
    assert done.model == SERVED and done.usage.completion_tokens == 4
    with SpecDecodeClient(stack.address) as grpc_client:
        assert grpc_client.model_info().model_name == SERVED
    names = set(re.findall(r'model_name="([^"]*)"',
                           Http(stack.metrics_ports["orchestrator"]).get("/metrics").text))
    assert names == {SERVED}


def test_tokenize_then_detokenize_round_trips(http, client):
    tokens = http.post("/tokenize", json={"model": SERVED, "prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 5 and tokens["max_model_len"] > 0
    assert tokens["token_strs"] is None
    back = http.post("/detokenize", json={"model": SERVED, "tokens": tokens["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    with_strs = http.post("/tokenize", json={"prompt": "a b", "return_token_strs": True}).json()
    assert with_strs["token_strs"] == ["a", "Ġb"]  # the tokenizer's own pieces
    # Messages go through the chat template, counted as the chat API counts its prompt.
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    done = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=2,
                                          temperature=0)
    assert chat["count"] == done.usage.prompt_tokens


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [49152]}, "tokens"),  # the vocabulary is 49152
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_refuses_bad_bodies_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_another_model_is_404_on_tokenize_too(http):
    r = http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_version_ping_and_health(http):
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", http.get("/version").json()["version"])
    assert http.get("/ping").status_code == http.post("/ping", content=b"").status_code == 200
    assert http.get("/health").status_code == 200


def test_x_request_id_is_echoed_or_generated(client):
    raw = client.completions.with_raw_response.create(
        model=SERVED, prompt=PROMPT, max_tokens=2, extra_headers={"X-Request-Id": "req-42"})
    assert raw.headers["x-request-id"] == "req-42"
    assert raw.parse().id == "cmpl-req-42"  # the generation's id is the client's
    fresh = [client.completions.with_raw_response.create(model=SERVED, prompt=PROMPT,
                                                         max_tokens=1) for _ in range(2)]
    ids = [r.headers["x-request-id"] for r in fresh]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1]
    assert [r.parse().id for r in fresh] == [f"cmpl-{i}" for i in ids]


def test_a_malformed_body_is_answered_in_words(http):
    r = http.post("/v1/completions", content=b'{"model": "smol", "prompt": "x",, }',
                  headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] is None
    assert error["message"].startswith("request body: not valid JSON (Expecting property name")
    assert r.headers["x-request-id"]  # errors carry one too


def test_http_requests_by_route_method_and_status_on_both_metrics_endpoints(stack, http):
    before = http_metrics(http.get("/metrics").text)
    http.post("/v1/completions", json={"model": SERVED, "prompt": PROMPT, "max_tokens": 0})
    http.post("/v1/completions", json={"model": "gpt-4", "prompt": PROMPT})
    http.get("/v1/nothing-here")
    http.get("/v1/completions")  # a route, the wrong method
    after = http_metrics(http.get("/metrics").text)
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grew[("/v1/completions", "POST", "400")] == 1
    assert grew[("/v1/completions", "POST", "404")] == 1
    assert grew[("unmatched", "GET", "404")] == 1
    assert grew[("/v1/completions", "GET", "405")] == 1
    assert grew[("/metrics", "GET", "200")] == 1  # the scrape before
    scraped = scrape_metrics(stack.metrics_ports["orchestrator"])  # the --metrics-port
    assert scraped['specdecode_http_requests_total{method="POST",route="/v1/completions",'
                   'status="404"}'] == after[("/v1/completions", "POST", "404")]


def test_http_metrics_carry_vllms_names_beside_ours(client, http):
    client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3, temperature=0)
    text = http.get("/metrics").text

    def value(name: str) -> float:
        (v,) = re.findall(rf'^{re.escape(name)}\{{model_name="{SERVED}"\}} (\S+)$', text, re.M)
        return float(v)
    for theirs, ours in (("vllm:prompt_tokens_total", "specdecode_prompt_tokens_total"),
                         ("vllm:generation_tokens_total", "specdecode_generation_tokens_total"),
                         ("vllm:time_to_first_token_seconds_count",
                          "specdecode_time_to_first_token_seconds_count"),
                         ("vllm:request_time_per_output_token_seconds_count",
                          "specdecode_time_per_output_token_seconds_count"),
                         ("vllm:num_requests_waiting", "specdecode_waiting_requests")):
        assert value(theirs) == value(ours), theirs
    assert value("specdecode_time_per_output_token_seconds_count") >= 1
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text


@pytest.mark.parametrize("messages, param, says", [
    ([{"role": "user", "content": ""}] * 60_000, "messages", "60000 messages render at least"),
    # below the message count limit, above it with the template's tokens per message
    ([{"role": "user", "content": ""}] * 3_000, "messages", "3000 messages render at least"),
    ([{"role": "r" * (1 << 20), "content": "hi"}], "messages[0].role", "1048576 bytes"),
])
def test_chat_is_refused_before_its_template_runs(http, messages, param, says):
    """Too many or too large messages get 400 naming the field from the bound on the
    rendered prompt (message count times the template's tokens per message, every part's
    bytes), not after tokenizing (that refusal says "tokens; the limit is")."""
    for path, body in (("/v1/chat/completions", {"model": SERVED, "max_tokens": 1}),
                       ("/tokenize", {})):
        r = http.post(path, json={**body, "messages": messages})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param, (path, r.text[:300])
        assert error["message"].startswith(param) and says in error["message"], error
