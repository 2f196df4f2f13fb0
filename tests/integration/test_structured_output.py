"""Structured output through the whole stack (three processes on loopback), with the official
`openai` client: 20 nested JSON schemas, greedy and sampled, every output valid against its
schema, greedy output the same with speculation on and off; regex and choice likewise; bad
schemas, bad regexes and a grammar too slow to compile answered with clear errors on both
APIs while the requests beside them go on unharmed.

Tiny random models over a byte-level tokenizer (tests/structured.py) serve: they write no
sensible JSON, so every valid output here is the grammar's work, and the schemas bound what
must end (string lengths, array sizes, anchored patterns, integer ranges)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from specdecode.api.client import SpecDecodeClient
from specdecode.v1.structured_output_pb2 import StructuredOutput
from specdecode_stack.local import LocalStack, StackConfig, free_port, wait_process_serving
from tests.structured import DRAFT, TARGET, tiny, tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
CITIES = ["Paris", "Lyon", "Nice", "Oslo", "Rome"]
K = 3


def nested_schema(i: int) -> dict:
    """The i-th of 20 nested schemas: objects in objects, arrays of objects and of enums,
    integers and numbers with bounds, booleans, required and optional fields."""
    item = {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{1,3}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 9 + i},
        "price": {"type": "number", "minimum": 0, "maximum": 100}},
        "required": ["sku", "qty"] if i % 2 else ["sku", "qty", "price"]}
    address = {"type": "object", "properties": {
        "city": {"enum": CITIES[:2 + i % 4]},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "geo": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90,
                                                         "maximum": 90}},
                "required": ["lat"]}},
        "required": ["city"] + (["geo"] if i % 3 == 0 else [])}
    props = {"id": {"type": "integer", "minimum": 0, "maximum": 10 ** (2 + i % 4)},
             "name": {"type": "string", "maxLength": 2 + i % 3},
             "status": {"enum": ["new", "paid", "sent"][:1 + i % 3]},
             "items": {"type": "array", "items": item, "minItems": 1, "maxItems": 1 + i % 2},
             "address": address,
             "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
             "gift": {"type": "boolean"}}
    keep = list(props)[:4 + i % 4]
    return {"type": "object", "properties": {k: props[k] for k in keep},
            "required": keep[:2 + i % 3]}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("byte_models")
    tok = tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    dirs = {}
    for name, spec in (("target", TARGET), ("draft", DRAFT)):
        dirs[name] = root / name
        tiny(dataclasses.replace(spec, max_position_embeddings=2048)).save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    return {k: str(v) for k, v in dirs.items()}


@pytest.fixture(scope="module")
def stack(model_dirs):
    config = StackConfig(target_model=model_dirs["target"], draft_model=model_dirs["draft"],
                         device="cpu", scoring="multi-query", speculation="fixed",
                         num_speculative_tokens=K, draft_vocab_size=0, draft_confidence=0.0,
                         port=0, http_port=free_port())
    with LocalStack(config) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.http_port}/v1",
                       api_key="unused", max_retries=0, timeout=600) as c:
        yield c


def chat(client, content: str, **kw):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=1500,
        messages=[{"role": "user", "content": content}], **kw)


def in_parallel(calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_nested_schemas_validate_and_greedy_ignores_speculation(client):
    def run(i, temperature, k):
        fmt = {"type": "json_schema", "json_schema": {"name": f"order{i}", "strict": True,
                                                      "schema": nested_schema(i)}}
        return lambda: chat(client, f"Order {i} as JSON.", response_format=fmt,
                            temperature=temperature, seed=i,
                            extra_body={"num_speculative_tokens": k})
    cases = [(i, t, k) for i in range(20) for t, k in ((0.0, K), (0.0, 0), (1.0, K))]
    done = dict(zip(cases, in_parallel([run(*c) for c in cases])))
    for (i, temperature, k), completion in done.items():
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", (i, temperature, k)
        jsonschema.validate(json.loads(choice.message.content), nested_schema(i))
    for i in range(20):
        assert (done[(i, 0.0, K)].choices[0].message.content
                == done[(i, 0.0, 0)].choices[0].message.content)
    assert all(done[(i, t, K)].usage.speculative["draft_tokens"] > 0
               for i in range(20) for t in (0.0, 1.0))
    assert all(done[(i, 0.0, 0)].usage.speculative["draft_tokens"] == 0 for i in range(20))


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"regex": r"(GET|POST) /[a-z]{1,6}(/[0-9]{1,3})?"}},
     lambda text: re.fullmatch(r"(GET|POST) /[a-z]{1,6}(/[0-9]{1,3})?", text)),
    ({"guided_choice": ["red", "green", "blue", "dark red"]},
     lambda text: text in ("red", "green", "blue", "dark red")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda text: text in ("yes", "no")),
])
def test_regex_and_choice_greedy_and_sampled(client, extra, check):
    calls = [lambda k=k, t=t, s=s: chat(client, f"Answer {s}.", temperature=t, seed=s,
                                        extra_body={**extra, "num_speculative_tokens": k})
             for s in range(4) for t, k in ((0.0, K), (0.0, 0), (1.0, K))]
    out = [c.choices[0].message.content for c in in_parallel(calls)]
    assert all(check(text) for text in out), out
    assert out[0::3] == out[1::3]  # greedy: speculation on == off


def test_grpc_structured_output_equals_openai(stack, client):
    schema = nested_schema(5)
    with SpecDecodeClient(stack.address) as grpc_client:
        result = grpc_client.generate("user: Order 5 as JSON.\nassistant: ", max_tokens=1500,
                                      structured_output=StructuredOutput(
                                          json_schema=json.dumps(schema)))
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), schema)
    via_openai = chat(client, "Order 5 as JSON.", temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "o", "schema": schema}})
    assert via_openai.choices[0].message.content == result.text


BAD = [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", "nonsense",
     StructuredOutput(json_schema='{"type": "nonsense"}'), "structured_output.json_schema"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex",
     "unclosed character class", StructuredOutput(regex="[a-"), "structured_output.regex"),
    ({"extra_body": {"guided_grammar": "start: missing_rule"}}, "guided_grammar",
     "missing_rule", StructuredOutput(grammar="start: missing_rule"), "structured_output.grammar"),
]


def test_bad_grammars_get_clear_errors_and_neighbours_go_on(stack, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": nested_schema(3)}}

    def neighbour():
        return chat(client, "Order 3 as JSON.", temperature=0, response_format=fmt)
    expected = neighbour().choices[0].message.content
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(neighbour) for _ in range(3)]
        for kwargs, param, words, proto, field in BAD:
            with pytest.raises(openai.BadRequestError) as err:
                chat(client, "x", **kwargs)
            body = err.value.body
            assert body["param"] == param and words in body["message"], body
            with SpecDecodeClient(stack.address) as grpc_client, \
                    pytest.raises(grpc.RpcError) as rpc:
                grpc_client.generate("x", max_tokens=8, structured_output=proto)
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rpc.value.details().startswith(field) and words in rpc.value.details()
        assert [f.result().choices[0].message.content for f in running] == [expected] * 3


def test_a_grammar_too_slow_to_compile_is_refused_and_remembered(stack, model_dirs):
    """A second orchestrator on the same services allows 1 ms to compile; a 60 KB grammar
    of 6,000 alternatives takes ~0.1 s here (100x that). A plain request streams meanwhile."""
    port, http = free_port(), free_port()
    proc = subprocess.Popen([
        sys.executable, "-m", "specdecode_stack.cli", "serve", "orchestrator", "--host",
        "127.0.0.1", "--port", str(port), "--http-port", str(http),
        "--proposer", stack.service_addresses["proposer"],
        "--scorer", stack.service_addresses["scorer"], "--tokenizer", model_dirs["target"],
        "--speculation", "fixed", "--num-speculative-tokens", str(K),
        "--grammar-compile-timeout", "0.001"])
    try:
        wait_process_serving(f"127.0.0.1:{port}", 120, proc)
        slow = "start: " + " | ".join(f'"t{i}"' for i in range(6000))
        with SpecDecodeClient(f"127.0.0.1:{port}") as grpc_client, \
                ThreadPoolExecutor(1) as pool, \
                openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="-",
                              max_retries=0, timeout=600) as slow_client:
            plain = pool.submit(grpc_client.generate, [104, 105], max_tokens=64)
            for _ in range(2):  # the second is answered from the compiler's memory
                with pytest.raises(openai.BadRequestError) as err:
                    slow_client.completions.create(
                        model=slow_client.models.list().data[0].id, prompt="x",
                        extra_body={"guided_grammar": slow})
                assert err.value.body["param"] == "guided_grammar"
                assert "did not compile within 0.001 s" in err.value.body["message"]
            with pytest.raises(grpc.RpcError) as rpc:
                grpc_client.generate("x", structured_output=StructuredOutput(grammar=slow))
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "did not compile within" in rpc.value.details()
            result = plain.result(timeout=600)
            assert result.finish_reason == "length" and len(result.token_ids) == 64
    finally:
        proc.terminate()
        proc.wait(60)
