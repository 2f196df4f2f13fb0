"""The real default model through the whole stack: text prompts, stop strings, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specdecode.api.client import SpecDecodeClient
from specdecode.models.checkpoints import load_model, load_tokenizer
from specdecode_stack.local import LocalStack, StackConfig

PROMPTS = ["def fibonacci(n):", "The capital of France is"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smol_stack():
    with LocalStack(StackConfig(device="cpu", scoring="multi-query", port=0)) as stack:
        yield stack


@pytest.fixture(scope="module")
def reference():
    model, tok = load_model(None, torch.device("cpu"), torch.float32), load_tokenizer(None)
    out = {}
    with torch.inference_mode():
        for p in PROMPTS:
            ids = tok(p).input_ids
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
            out[p] = gen[0, len(ids):].tolist()
    return out, tok


def test_text_prompts_equal_target_greedy(smol_stack, reference):
    expected, tok = reference
    with SpecDecodeClient(smol_stack.address) as client:
        for prompt in PROMPTS:
            result = client.generate(prompt, max_tokens=MAX_TOKENS)
            assert result.token_ids == expected[prompt]
            assert result.text == tok.decode(expected[prompt], skip_special_tokens=True)


def test_stop_string_cuts_text(smol_stack, reference):
    expected, tok = reference
    full = tok.decode(expected[PROMPTS[0]], skip_special_tokens=True)
    stop = full[8:12]  # a piece from inside the greedy continuation
    with SpecDecodeClient(smol_stack.address) as client:
        result = client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.text == full[:full.index(stop)]


def test_cli_generate_json(smol_stack, reference):
    expected, _ = reference
    out = subprocess.run([sys.executable, "-m", "specdecode_stack.cli", "generate", "--address",
                          smol_stack.address, "--max-tokens", str(MAX_TOKENS), "--json",
                          PROMPTS[1]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # exactly one JSON object
    assert result["token_ids"] == expected[PROMPTS[1]]
    assert result["finish_reason"] == "length"
    assert set(result["usage"]) == {"prompt_tokens", "completion_tokens", "draft_tokens",
                                    "accepted_tokens", "emitted_tokens", "acceptance_rate",
                                    "steps"}
    assert result["usage"]["completion_tokens"] == MAX_TOKENS



def test_cli_generate_reads_stdin_and_address_from_env(smol_stack, reference):
    """`-` reads the prompt from stdin, SPECDECODE_ADDRESS names the server, --stop cuts the
    text; the text alone is on stdout and the summary line on stderr."""
    expected, tok = reference
    full = tok.decode(expected[PROMPTS[0]], skip_special_tokens=True)
    stop = full[8:12]  # as in test_stop_string_cuts_text
    env = {**os.environ, "SPECDECODE_ADDRESS": smol_stack.address}
    out = subprocess.run([sys.executable, "-m", "specdecode_stack.cli", "generate",
                          "--max-tokens", str(MAX_TOKENS), "--stop", stop, "-"],
                         input=PROMPTS[0], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == full[:full.index(stop)] + "\n"
    (summary,) = out.stderr.strip().splitlines()
    assert "tokens in" in summary
    assert summary.endswith("finish: stop")
