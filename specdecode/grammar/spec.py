"""What a request asks its output to be: one of five kinds, checked for shape here (cheap, no
tokenizer) and turned into an llguidance grammar. Compiling it is specdecode.grammar.compiler's
work."""

from __future__ import annotations

import json
from dataclasses import dataclass

from specdecode.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # larger specs are refused: compile time grows faster than size
# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): a small model
# cannot wander into endless whitespace, and every service builds the same grammar.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """One request's grammar. kind json_schema: `spec` is the schema's JSON text; regex: the
    pattern (Rust regex syntax, anchored at both ends); grammar: Lark or GBNF (llama.cpp)
    text; choice: `choices`, the output is exactly one of them; json_object: any JSON object."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """The field that carries it on the wire, for error messages."""
        return f"structured_output.{self.kind}"

    def validate(self, field: str | None = None) -> None:
        """InvalidRequestError naming `field` (default self.field) for a malformed spec."""
        field = field or self.field
        if self.kind not in KINDS:
            raise InvalidRequestError("structured_output",
                                      f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        size = len(self.spec) + sum(len(c) for c in self.choices)
        if size > MAX_SPEC_CHARS:
            raise InvalidRequestError(field, f"{size} characters; the limit is {MAX_SPEC_CHARS}")
        if self.kind == "choice":
            if not self.choices:
                raise InvalidRequestError(field, "needs at least one choice")
        elif self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise InvalidRequestError(field, f"is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidRequestError(field, f"must be a JSON object, got {self.spec[:40]}")
        elif self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(field, "must not be empty")

    def to_llguidance(self) -> str:
        """The llguidance grammar (its JSON form); ValueError when the text cannot be
        converted (a GBNF grammar that does not parse)."""
        from llguidance import LLMatcher, grammar_from

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return grammar_from("choice", json.dumps(list(self.choices)))
        return grammar_from("grammar", self.spec)  # Lark, or GBNF converted to Lark


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "not", "if", "then", "else", "contains", "additionalProperties")


def closed_objects(schema):
    """The schema with `additionalProperties: false` wherever an object schema leaves it
    unset (OpenAI's strict mode; vLLM's disable_additional_properties). A new value."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            value = out[key]
            out[key] = ([closed_objects(s) for s in value] if isinstance(value, list)
                        else closed_objects(value))
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
