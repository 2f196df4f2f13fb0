"""Structured output in the OpenAI API's words: OpenAI's `response_format` (text, json_object,
json_schema with strict), vLLM's `structured_outputs` (json, regex, choice, grammar,
json_object; vLLM >= 0.10.2) and the `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` fields that vLLM accepted before 0.12. At most one of them; each becomes the
one StructuredOutput both APIs share, with the field to name in errors."""

from __future__ import annotations

import json
from typing import Any

from specdecode.errors import InvalidRequestError
from specdecode.grammar.spec import StructuredOutput, closed_objects

# structured_outputs keys -> our kinds; the options after them are accepted as vLLM means
# them where this server behaves so anyway (JSON never has free whitespace here; there is
# one grammar engine, so nothing to fall back to), `disable_additional_properties` is applied.
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "json_object"}
_OPTIONS = {"disable_any_whitespace", "disable_fallback", "disable_additional_properties"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_output_of(body) -> tuple[StructuredOutput | None, str]:
    """The body's grammar and the field that gave it ("" when none); InvalidRequestError
    naming the field when it is malformed or more than one field asks for one."""
    given = []
    fmt = body.response_format
    if fmt and fmt.get("type", "text") != "text":
        given.append(("response_format", _response_format(fmt)))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    guided = {name: getattr(body, name) for name in _GUIDED if getattr(body, name) is not None}
    if guided:
        given.append((next(iter(guided)), _structured_outputs(
            {_GUIDED[name]: value for name, value in guided.items()}, prefix="guided_")))
    if body.guided_whitespace_pattern is not None:
        raise InvalidRequestError("guided_whitespace_pattern", "not supported by this server "
                                  "(JSON is written with \", \" and \": \" only)")
    if len(given) > 1:
        raise InvalidRequestError(given[1][0], f"only one structured output field per request "
                                               f"({given[0][0]} is set too)")
    return given[0][1] if given else (None, "")


def _response_format(fmt: dict[str, Any]) -> tuple[StructuredOutput, str]:
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutput("json_object"), "response_format"
    if kind != "json_schema":
        raise InvalidRequestError("response_format.type", "must be text, json_object or "
                                                          f"json_schema, got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidRequestError("response_format.json_schema.schema",
                                  "a JSON schema object is required")
    schema = closed_objects(spec["schema"]) if spec.get("strict") else spec["schema"]
    return (StructuredOutput("json_schema", json.dumps(schema)),
            "response_format.json_schema.schema")


def _structured_outputs(fields: Any, prefix: str = "") -> tuple[StructuredOutput, str]:
    """vLLM's StructuredOutputsParams (or the guided_* fields, named with `prefix`)."""
    where = (lambda key: f"{prefix}{key}") if prefix else (lambda key: f"structured_outputs.{key}")
    if not isinstance(fields, dict):
        raise InvalidRequestError("structured_outputs", "must be an object")
    unknown = set(fields) - set(_KINDS) - _OPTIONS
    if unknown:
        key = sorted(unknown)[0]
        raise InvalidRequestError(where(key), "not supported by this server")
    kinds = [key for key in _KINDS if fields.get(key) not in (None, False)]
    if len(kinds) != 1:
        raise InvalidRequestError(where(kinds[1]) if kinds else "structured_outputs",
                                  f"exactly one of {', '.join(where(k) for k in _KINDS)} "
                                  f"may be set, got {', '.join(map(where, kinds)) or 'none'}")
    key = kinds[0]
    value, field = fields[key], where(key)
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(field, "must be a list of strings")
        return StructuredOutput("choice", choices=tuple(value)), field
    if key == "json_object":
        return StructuredOutput("json_object"), field
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequestError(field, f"is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise InvalidRequestError(field, "must be a JSON schema object")
        if fields.get("disable_additional_properties"):
            value = closed_objects(value)
        return StructuredOutput("json_schema", json.dumps(value)), field
    if not isinstance(value, str):
        raise InvalidRequestError(field, "must be a string")
    return StructuredOutput(_KINDS[key], value), field
