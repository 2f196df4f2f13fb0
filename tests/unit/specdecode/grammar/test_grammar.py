"""specdecode.grammar: specs checked for shape, compile errors and the time limit naming the
field, matchers that roll back exactly, forced tokens, masks in sample_logits, the wire."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.wire import codec
from specdecode.grammar.compiler import GrammarCompiler
from specdecode.grammar.matcher import SequenceMatcher, bitmask_to_allowed
from specdecode.grammar.spec import MAX_SPEC_CHARS, StructuredOutput, closed_objects
from specdecode.sampling import sample_logits
from specdecode.sequence import InvalidRequestError, SamplingParams
from tests.structured import EOS, VOCAB, allowed_after, compiler, tokenizer

SCHEMA = StructuredOutput("json_schema", json.dumps(
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
     "required": ["a", "b"], "additionalProperties": False}))


def ids(text: str) -> list[int]:
    return list(text.encode())


@pytest.mark.parametrize("so,field,words", [
    (StructuredOutput("yaml", "a: 1"), "structured_output", "kind must be one of"),
    (StructuredOutput("regex", ""), "structured_output.regex", "must not be empty"),
    (StructuredOutput("choice"), "structured_output.choice", "at least one choice"),
    (StructuredOutput("json_schema", "{not json"), "structured_output.json_schema",
     "not valid JSON"),
    (StructuredOutput("json_schema", "[1]"), "structured_output.json_schema",
     "must be a JSON object"),
    (StructuredOutput("regex", "a" * (MAX_SPEC_CHARS + 1)), "structured_output.regex",
     "the limit is"),
])
def test_malformed_specs_are_refused_before_compiling(so, field, words):
    with pytest.raises(InvalidRequestError) as err:
        so.validate()
    assert err.value.field == field and words in err.value.detail


@pytest.mark.parametrize("so,words", [
    (StructuredOutput("regex", "[a-"), "unclosed character class"),
    (StructuredOutput("json_schema", '{"type": "nonsense"}'), "nonsense"),
    (StructuredOutput("grammar", "start: foo"), "foo"),
    (StructuredOutput("grammar", "root ::= [a-"), "GBNF"),
])
def test_specs_that_do_not_compile_name_the_field_and_the_problem(so, words):
    with pytest.raises(InvalidRequestError) as err:
        compiler().matcher(so, field="response_format.json_schema")
    assert err.value.field == "response_format.json_schema"
    assert words in err.value.detail and len(err.value.detail) <= 300


def test_a_slow_compile_is_refused_within_the_limit_and_remembered():
    """6,000 alternatives (60 KB) compile in ~0.1 s here: 1000x the limit set below."""
    slow = StructuredOutput("grammar", "start: " + " | ".join(f'"t{i}"' for i in range(6000)))
    c = GrammarCompiler(tokenizer(), VOCAB, timeout_s=1e-4)
    for _ in range(2):  # the second answer comes from the cache: no new compile
        with pytest.raises(InvalidRequestError, match="did not compile within 0.0001 s"):
            c.matcher(slow)
    assert c.compiles == 1


def test_matcher_rolls_back_to_the_common_prefix_exactly():
    doc = ids('{"a": 12, "b": "y"}')
    m = SequenceMatcher(SCHEMA, compiler().matcher(SCHEMA), EOS, VOCAB)
    assert m.sync(doc)
    assert m.forced_token() == EOS  # complete: only the end remains
    for cut in (12, 3, 0):  # a rejection keeps the prefix, whatever was consumed after it
        assert m.sync(doc[:cut])
        assert torch.equal(bitmask_to_allowed(m.bitmask()[None], VOCAB)[0],
                           allowed_after(SCHEMA, doc[:cut]))


def test_disallowed_tokens_and_the_end_token_stop_the_sync():
    m = SequenceMatcher(SCHEMA, compiler().matcher(SCHEMA), EOS, VOCAB)
    assert not m.sync(ids('{"a": x'))  # x is no digit
    assert m.tokens == ids('{"a": ')
    assert not m.sync(ids('{"a": 1') + [EOS])  # an end token mid-grammar
    assert m.tokens == ids('{"a": 1')


def test_forced_tokens_are_the_only_allowed_ones():
    m = SequenceMatcher(SCHEMA, compiler().matcher(SCHEMA), EOS, VOCAB)
    m.sync(ids('{"a'))
    assert m.forced_token() == ord('"')  # the key is "a"
    m.sync(ids('{"a": '))
    assert m.forced_token() is None  # any digit or a minus


def test_masks_shape_greedy_and_sampled_rows_alike():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[:, ord("q")] = 50.0  # the unconstrained favourite, disallowed below
    allowed = allowed_after(StructuredOutput("choice", choices=("ab", "cd")), [])[None].repeat(2, 1)
    out = sample_logits(logits, [SamplingParams(), SamplingParams(temperature=1.0, seed=1)],
                        [3, 3], "target", want_probs=True, want_logprobs=False,
                        allowed=allowed)
    assert set(out.sampled_token_ids.tolist()) <= {ord("a"), ord("c")}
    probs = out.sampled_token_probs
    assert probs[:, ~allowed[0]].sum() == 0 and torch.allclose(probs.sum(-1), torch.ones(2))


@pytest.mark.parametrize("so", [SCHEMA, StructuredOutput("json_object"),
                                StructuredOutput("regex", "[0-9]+"),
                                StructuredOutput("choice", choices=("a", "b b")),
                                StructuredOutput("grammar", 'start: "x"')])
def test_structured_output_travels_in_the_sampling_params(so):
    params = SamplingParams(temperature=0.5, structured_output=so)
    m = codec.sampling_params_to_proto(params)
    assert codec.sampling_params_from_proto(m) == params
    assert codec.sampling_params_from_proto(codec.sampling_params_to_proto(SamplingParams())) \
        .structured_output is None


def test_json_object_false_is_refused():
    m = codec.sampling_params_to_proto(SamplingParams())
    m.structured_output.json_object = False
    with pytest.raises(InvalidRequestError, match="must be true"):
        codec.sampling_params_from_proto(m, "request.sampling_params")


def test_closed_objects_closes_every_object_schema_and_nothing_else():
    schema = {"type": "object", "properties": {
        "properties": {"type": "string"},  # a property named like the keyword
        "items": {"type": "array", "items": {"type": "object", "properties": {}}},
        "open": {"type": "object", "additionalProperties": True}},
        "$defs": {"d": {"anyOf": [{"type": "object"}, {"type": "null"}]}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]
    assert closed["properties"]["items"]["items"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["$defs"]["d"]["anyOf"][1]
    assert schema["properties"]["items"]["items"] == {"type": "object", "properties": {}}
