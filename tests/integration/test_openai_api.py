"""The OpenAI-compatible HTTP API with the official `openai` client, and logprobs / model info
through gRPC, on the real default model (SmolLM2-135M-Instruct, float32) with speculation
on: the model drafts for itself (k = 4, multi-query scoring), three processes on loopback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import openai
import pytest
import torch

from specdecode.api.client import AsyncSpecDecodeClient, SpecDecodeClient
from specdecode.models.checkpoints import load_model, load_tokenizer
from specdecode_stack.local import LocalStack, StackConfig, free_port

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def stack():
    # Fixed k: with the draft as costly as the target, adaptive speculation would choose none.
    # A proposer call may take a minute: sized from the step's work (1 s and up), a call
    # preempted by busy loops beside the suite timed out, the replica went down and a
    # request drafted nothing (the logprobs test asserts the speculative path).
    config = StackConfig(device="cpu", scoring="multi-query", draft_model="default", port=0,
                         speculation="fixed", http_port=free_port(),
                         orchestrator_args=["--proposer-timeout", "60"])
    with LocalStack(config) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{stack.config.http_port}/v1",
                       api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(client):
    (model,) = client.models.list().data
    return model.id


@pytest.fixture(scope="module")
def target():
    """The target model alone, in this process: the reference for log-probabilities."""
    return load_model(None, torch.device("cpu"), torch.float32), load_tokenizer(None)


def cli_generate(stack, prompt: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "specdecode_stack.cli", "generate", "--address",
                          stack.address, "--max-tokens", str(MAX_TOKENS), "--json", prompt],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_models_and_health(stack, client, model_name):
    assert model_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    health = urllib.request.urlopen(f"http://127.0.0.1:{stack.config.http_port}/health")
    assert health.status == 200
    with SpecDecodeClient(stack.address) as grpc_client:
        info = grpc_client.model_info()
    assert (info.model_name, info.draft_model_name) == (model_name, model_name)
    assert info.vocab_size == 49152
    assert info.num_speculative_tokens == StackConfig.num_speculative_tokens
    assert info.scoring_method == "multi-query" and info.has_tokenizer
    assert info.max_logprobs == 20 and info.max_model_len > 0


def test_completions_greedy_equals_specdecode_generate(stack, client, model_name):
    expected = cli_generate(stack, PROMPT)
    done = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     temperature=0)
    assert done.choices[0].text == expected["text"]
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == MAX_TOKENS
    assert done.usage.speculative["draft_tokens"] > 0  # speculation was on
    chunks = list(client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.speculative["accepted_tokens"] > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_equals_specdecode_generate_on_the_template(stack, client, model_name,
                                                                 target):
    _, tok = target
    templated = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    expected = cli_generate(stack, templated)
    done = client.chat.completions.create(model=model_name, messages=CHAT,
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected["text"]
    assert done.usage.prompt_tokens == len(tok(templated).input_ids)
    chunks = list(client.chat.completions.create(
        model=model_name, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_logprobs_through_http_are_the_target_models_own(client, model_name, target):
    model, tok = target
    prompt_ids = tok(PROMPT).input_ids
    done = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.8, seed=3,
        logprobs=3, presence_penalty=0.5, extra_body={"return_tokens_as_token_ids": True})
    lp = done.choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert len(ids) == MAX_TOKENS and done.usage.speculative["draft_tokens"] > 0
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt_ids + ids])).logits[0].double(), -1)
    for j, (t, got, top) in enumerate(zip(ids, lp.token_logprobs, lp.top_logprobs)):
        row = ref[len(prompt_ids) - 1 + j]
        assert got == pytest.approx(float(row[t]), abs=1e-3)
        best = row.topk(3)
        assert list(top) == [f"token_id:{i}" for i in best.indices.tolist()]
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=1e-3)
    # Chat: the same shape OpenAI gives (token text, bytes, top_logprobs).
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.logprob for e in content)  # greedy picks the top


def test_logprobs_through_grpc_are_the_target_models_own(stack, target):
    model, tok = target
    prompt_ids = tok(PROMPT).input_ids
    with SpecDecodeClient(stack.address) as c:
        result = c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.8, seed=5, logprobs=2,
                            repetition_penalty=1.3)
    assert result.usage.draft_tokens > 0
    with torch.inference_mode():
        ref = torch.log_softmax(
            model(torch.tensor([prompt_ids + result.token_ids])).logits[0].double(), -1)
    assert [e.token_id for e in result.logprobs] == result.token_ids
    for j, e in enumerate(result.logprobs):
        row = ref[len(prompt_ids) - 1 + j]
        assert e.logprob == pytest.approx(float(row[e.token_id]), abs=1e-3)
        assert [t.token_id for t in e.top_logprobs] == row.topk(2).indices.tolist()


def test_n_samples_and_the_async_client(stack, client, model_name):
    done = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8,
                                     temperature=1.0, seed=11, n=3)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert done.usage.completion_tokens == 24  # three samples of 8
    assert done.usage.prompt_tokens == client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=1).usage.prompt_tokens  # counted once

    async def grpc_samples():
        async with AsyncSpecDecodeClient(stack.address) as c:
            return await c.samples(PROMPT, max_tokens=8, temperature=1.0, seed=11, n=3)
    samples = asyncio.run(grpc_samples())
    # Same seeds (sample i: seed + i), same engine: the HTTP and gRPC samples agree.
    assert [s.text for s in samples] == [c.text for c in done.choices]
    assert len({s.text for s in samples}) > 1  # independent samples


@pytest.mark.parametrize("kwargs, status, param", [
    (dict(temperature=-1), 400, "temperature"),
    (dict(top_p=1.5), 400, "top_p"),
    (dict(logprobs=21), 400, "logprobs"),
    (dict(extra_body={"min_p": 2}), 400, "min_p"),
    (dict(logit_bias={"x": 1}), 400, "logit_bias"),
    (dict(logit_bias={"50000": 1}), 400, "logit_bias"),
    (dict(max_tokens="many"), 400, "max_tokens"),
    (dict(model="gpt-4"), 404, "model"),
    (dict(echo=True), 400, "echo"),
])
def test_bad_input_gets_openais_error_shape(client, model_name, kwargs, status, param):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**{"model": model_name, "prompt": PROMPT, "max_tokens": 4,
                                     **kwargs})
    err = info.value
    assert err.status_code == status
    body = err.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["message"].startswith(param)
    assert err.type == ("invalid_request_error")
    if status == 404:
        assert err.code == "model_not_found"
