"""Structured output: a request's grammar (JSON schema, any JSON object, regex, choice, Lark
or GBNF grammar) as an allowed-token mask at every position, for the draft and the target
alike (docs/design.md, Structured output). The engine is llguidance (`bench/structured_bench.py
engines` measured it against xgrammar and outlines-core)."""
