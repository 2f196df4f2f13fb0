"""The `specdecode` command's options in-process: defaults from StackConfig, and the
stop string read from the environment as one string."""

from __future__ import annotations

from specdecode_stack.cli import main
from specdecode_stack.local import StackConfig

# Defaults that differ on purpose: a server alone drains for 20 s (a pod's termination grace),
# the local stack's for 10 s; `up` and `serve orchestrator` serve the HTTP API on 8000, the
# programmatic stack (tests, benchmarks) leaves it off; the stack derives the orchestrator's
# --tokenizer from its target model.
OWN_DEFAULTS = {"grace_seconds", "http_port", "tokenizer"}


def test_cli_defaults_are_the_stack_config_defaults():
    """`up`, `demo` and `serve` take every default they share with the local stack from
    StackConfig (one source). Each service has its own port; the proposer's --model is the
    stack's draft model."""
    defaults = vars(StackConfig())
    serve = main.commands["serve"].commands
    checked = []
    for command in (main.commands["up"], main.commands["demo"], *serve.values()):
        for param in command.params:
            if param.name not in defaults or param.name in OWN_DEFAULTS:
                continue
            if param.name == "port" and command.name not in ("up", "demo"):
                continue
            assert param.default == defaults[param.name], (command.name, param.name)
            checked.append((command.name, param.name))
    assert len(checked) >= 20, checked
    assert {p.name: p.default for p in serve["proposer"].params}["model"] == \
        defaults["draft_model"]
    assert {p.name: p.default for p in serve["orchestrator"].params}["port"] == defaults["port"]


def test_stop_from_the_environment_is_one_string_spaces_and_newlines_included(monkeypatch):
    """click splits a repeatable option's environment variable on whitespace: "\\n\\n" would
    become no stop string at all and "END OF" two. SPECDECODE_STOP holds exactly one."""
    generate = main.commands["generate"]
    for value in ("\n\n", "END OF TEXT"):
        monkeypatch.setenv("SPECDECODE_STOP", value)
        assert generate.make_context("generate", ["prompt"]).params["stop"] == (value,)
    assert generate.make_context("generate", ["--stop", "a b", "--stop", "c", "x"]
                                 ).params["stop"] == ("a b", "c")  # the flag wins over the env
