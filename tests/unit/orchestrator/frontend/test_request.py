"""The public request's one validation (orchestrator.frontend.request): every bad field is
named, before any tokenizing for the bounds that need none; max_tokens is checked there only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.frontend.request import GenerationRequest, RequestLimits
from specdecode.errors import InvalidRequestError
from specdecode.sequence import SamplingParams

ROOT = Path(__file__).resolve().parents[4]
LIMITS = RequestLimits(max_model_len=256, max_prompt_tokens=255, num_speculative_tokens=3,
                       vocab_size=256, default_max_tokens=32)


def request(prompt=(1, 2, 3), **kw) -> GenerationRequest:
    params = kw.pop("params", {})
    return GenerationRequest(list(prompt) if not isinstance(prompt, str) else prompt,
                             SamplingParams(**params), **kw)


@pytest.mark.parametrize("req, field", [
    (request([1] * 256), "prompt"),
    (request(num_speculative_tokens=-1), "num_speculative_tokens"),
    (request(num_speculative_tokens=4), "num_speculative_tokens"),
    (request(max_tokens=0), "max_tokens"),
    (request(n=0), "n"),
    (request(n=17), "n"),
    (request(request_id="i" * 129), "request_id"),
    (request("x" * (255 * 32 + 1), prompt_field="prompt.text"), "prompt.text"),
    (request(stop=[""]), "stop[0]"),
    (request(stop=["a"] * 17), "stop"),
    (request(params=dict(temperature=-0.5)), "temperature"),
    (request(params=dict(temperature=float("inf"))), "temperature"),
    (request(params=dict(temperature=float("nan"))), "temperature"),
    (request(params=dict(temperature=1.0, top_p=0.0)), "top_p"),
    (request(params=dict(top_k=-1)), "top_k"),
    (request(params=dict(min_p=float("nan"))), "min_p"),
    (request(params=dict(stop_token_ids=(300,))), "stop_token_ids"),
    (request(params=dict(logprobs=21)), "logprobs"),
])
def test_check_names_the_field_before_tokenizing(req, field):
    with pytest.raises(InvalidRequestError) as err:
        LIMITS.check(req)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


@pytest.mark.parametrize("prompt, kw, field", [
    ([], {}, "prompt"),
    ([1, 256], {}, "prompt.token_ids"),
    ([1] * 256, {}, "prompt"),
    ([1] * 250, {"max_tokens": 7}, "max_tokens"),
])
def test_resolve_names_what_needs_the_tokens(prompt, kw, field):
    req = request(prompt, **kw)
    with pytest.raises(InvalidRequestError) as err:
        LIMITS.check(request())  # the other bounds hold
        LIMITS.resolve(req, prompt, "r", eos_token_id=None)
    assert err.value.field == field


def test_resolve_applies_the_defaults():
    gen = LIMITS.resolve(request([1] * 240, params=dict(stop_token_ids=(7,))), [1] * 240,
                         "r", eos_token_id=2)
    assert gen.params.max_tokens == 16  # the default 32, cut to the room the model leaves
    assert gen.params.stop_token_ids == (7, 2)  # the end token stops unless ignore_eos
    gen = LIMITS.resolve(request(ignore_eos=True, max_tokens=5), [1, 2], "r", eos_token_id=2)
    assert (gen.params.max_tokens, gen.params.stop_token_ids) == (5, ())
    assert [r.request_id for r in LIMITS.resolve(request(n=2), [1], "r", None).requests()] == \
        ["r/0", "r/1"]


def test_a_text_prompt_or_stop_string_needs_a_tokenizer():
    bare = RequestLimits(256, 255, 3, 256, has_tokenizer=False)
    for req, field in ((request("hi", prompt_field="prompt.text"), "prompt.text"),
                       (request(stop=["\n"]), "stop")):
        with pytest.raises(InvalidRequestError, match=f"^{re.escape(field)}: .*tokenizer"):
            bare.check(req)


def test_only_the_request_validator_checks_max_tokens():
    """Issue 19: one place validates max_tokens (no API, engine or data model re-checks it)."""
    libraries = ("orchestrator", "specdecode", "proposer_svc", "scorer_svc", "specdecode_stack")
    naming = [str(p.relative_to(ROOT)) for d in libraries for p in (ROOT / d).rglob("*.py")
              if re.search(r"InvalidRequestError\(\s*\"max_tokens\"", p.read_text())]
    assert naming == ["orchestrator/frontend/request.py"]


# The chat template's part of each message (SmolLM2's "<|im_start|>user\n<|im_end|>\n").
CHAT_LIMITS = RequestLimits(256, 255, 3, 256, chat_message_tokens=4, chat_message_bytes=28)
EMPTY = {"role": "user", "content": ""}


@pytest.mark.parametrize("messages, field, says", [
    ([EMPTY] * 64, "messages", "64 messages render at least 256 tokens"),  # 64 < 255
    ([{"role": "user", "content": "x" * 8150}], "messages", "bytes rendered"),
    ([{"role": "u" * 1_000_000, "content": ""}], "messages[0].role", "1000000 bytes"),
    ([EMPTY, {**EMPTY, "name": "n" * 300}], "messages[1].name", "300 bytes"),
])
def test_a_conversation_is_bounded_before_its_template_runs(messages, field, says):
    """Message count times the template's tokens per message, and every part's bytes plus
    the template's, against the prompt limit; a role or name over its bound is named."""
    with pytest.raises(InvalidRequestError) as err:
        CHAT_LIMITS.check_messages(messages)
    assert err.value.field == field and says in str(err.value), str(err.value)
    CHAT_LIMITS.check_messages([EMPTY] * 63)  # 63 x 4 = 252 tokens: may fit


def test_the_template_overhead_is_measured_from_the_tokenizer():
    """SmolLM2's template adds "<|im_start|>user\\n<|im_end|>\\n" per message: 5 tokens
    (4 counted: the bound stays below what renders), 28 bytes."""
    from orchestrator.frontend.chat_template import message_overhead
    from specdecode.models.checkpoints import load_tokenizer
    assert message_overhead(load_tokenizer(None)) == (4, 28)
    assert message_overhead(None) == (1, 0)
