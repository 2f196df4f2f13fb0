"""The OpenAI API's structured output fields, read into the one StructuredOutput: what each
spelling means, which combinations and options are refused, and the fields errors name."""

from __future__ import annotations

import json

import pytest

from orchestrator.frontend.openai_protocol import ChatCompletionRequest, CompletionRequest
from orchestrator.frontend.openai_structured import structured_output_of
from specdecode.errors import InvalidRequestError
from specdecode.grammar.spec import StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def read(**fields):
    return structured_output_of(CompletionRequest(prompt="x", **fields))


@pytest.mark.parametrize("fields,kind,field", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
     "json_schema", "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}}, "regex",
     "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object"),
    ({"guided_json": SCHEMA}, "json_schema", "guided_json"),
    ({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, "regex", "guided_regex"),
    ({"guided_grammar": 'start: "a"'}, "grammar", "guided_grammar"),
])
def test_each_spelling_reads_as_its_kind(fields, kind, field):
    so, where = read(**fields)
    assert so.kind == kind and where == field


def test_choice_and_text_formats():
    assert read(guided_choice=["a", "b"])[0] == StructuredOutput("choice", choices=("a", "b"))
    assert read(structured_outputs={"choice": ["x"]})[0].choices == ("x",)
    assert read(response_format={"type": "text"}) == (None, "")
    assert read() == (None, "")
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 response_format={"type": "json_object"})
    assert structured_output_of(chat)[0].kind == "json_object"


def test_strict_and_disable_additional_properties_close_objects():
    strict = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA,
                                                     "strict": True}}
    assert json.loads(read(response_format=strict)[0].spec)["additionalProperties"] is False
    loose = {**strict, "json_schema": {**strict["json_schema"], "strict": False}}
    assert "additionalProperties" not in json.loads(read(response_format=loose)[0].spec)
    so, _ = read(structured_outputs={"json": SCHEMA, "disable_additional_properties": True})
    assert json.loads(so.spec)["additionalProperties"] is False


@pytest.mark.parametrize("fields,field,words", [
    ({"response_format": {"type": "yaml"}}, "response_format.type", "must be text"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format.json_schema.schema", "required"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice",
     "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "not valid JSON"),
    ({"guided_choice": ["a"], "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "not supported"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "only one"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "exactly one"),
])
def test_malformed_or_conflicting_fields_name_the_field(fields, field, words):
    with pytest.raises(InvalidRequestError) as err:
        read(**fields)
    assert err.value.field == field and words in err.value.detail
