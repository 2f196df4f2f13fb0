"""The `specdecode` command's options in-process: defaults from StackConfig, --help in named
sections, and the stop string read from the environment as one string."""

from __future__ import annotations

import re

import click

from specdecode_stack.cli import main
from specdecode_stack.local import StackConfig

# Defaults that differ on purpose: a server alone drains for 20 s (a pod's termination grace),
# the local stack's for 10 s; `up` and `serve orchestrator` serve the HTTP API on 8000, the
# programmatic stack (tests, benchmarks) leaves it off; the stack derives the orchestrator's
# --tokenizer from its target model; `up` logs warnings as text, a server alone info as JSON
# (the programmatic stack leaves both to the servers).
OWN_DEFAULTS = {"grace_seconds", "http_port", "tokenizer", "log_format", "log_level"}


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


def test_help_lists_every_option_in_a_named_section():
    """`up`, `demo` and each `serve` list their options in sections (click's own help
    formatter); only --help is left for "Other options"."""
    serve = main.commands["serve"].commands
    for command in (main.commands["up"], main.commands["demo"], *serve.values()):
        # As the CLI runs them (click keeps a command's help option once made).
        text = command.get_help(click.Context(command, info_name=command.name,
                                              help_option_names=["-h", "--help"]))
        sections = re.findall(r"^(\w[\w ]*):\n((?:  .*\n|\n(?=  ))*)", text + "\n", re.M)
        titles = [title for title, _ in sections if title != "Usage"]
        assert len(titles) >= 4 and titles[-1] == "Other options", (command.name, titles)
        assert re.findall(r"^  (-\S+)", dict(sections)["Other options"], re.M) == ["-h,"]
        listed = {o for _, body in sections for o in re.findall(r"^  (--[\w-]+)", body, re.M)}
        options = {o.split("/")[0] for p in command.params for o in p.opts if o.startswith("--")}
        assert options == listed - {"--help"}, (command.name, options ^ listed)
    orchestrator = serve["orchestrator"].get_help(click.Context(serve["orchestrator"]))
    assert re.search(r"^HTTP API:\n  --http-port", orchestrator, re.M)


def test_stop_from_the_environment_is_one_string_spaces_and_newlines_included(monkeypatch):
    """click splits a repeatable option's environment variable on whitespace: "\\n\\n" would
    become no stop string at all and "END OF" two. SPECDECODE_STOP holds exactly one."""
    generate = main.commands["generate"]
    for value in ("\n\n", "END OF TEXT"):
        monkeypatch.setenv("SPECDECODE_STOP", value)
        assert generate.make_context("generate", ["prompt"]).params["stop"] == (value,)
    assert generate.make_context("generate", ["--stop", "a b", "--stop", "c", "x"]
                                 ).params["stop"] == ("a b", "c")  # the flag wins over the env
