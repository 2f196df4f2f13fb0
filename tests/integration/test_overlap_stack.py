"""Overlap through the stack, with sequence deltas: every stream equals the in-process
engine without overlap."""

from __future__ import annotations

import concurrent.futures

import pytest

from specdecode.api.client import SpecDecodeClient
from specdecode_stack.local import LocalStack, StackConfig
from tests.support.overlap import PROMPTS, engines, params, requests


@pytest.fixture(scope="module")
def overlap_stack(tiny_model_dirs):
    with LocalStack(StackConfig(
            target_model=tiny_model_dirs["target"], draft_model=tiny_model_dirs["draft"],
            tokenizer="none", device="cpu", num_speculative_tokens=3, port=0,
            speculation="fixed", draft_confidence=0.0,  # as the in-process engine's draft
            extra_env={"SPECDECODE_OVERLAP": "true"})) as stack:
        yield stack


def test_stack_with_overlap_and_deltas_equals_in_process(overlap_stack, target_model,
                                                         draft_model):
    """8 concurrent streams (greedy and seeded top-p) through the stack with overlap and
    sequence deltas on: each equals the in-process engine without overlap, the greedy
    ones target-only decoding."""
    want = engines(target_model, draft_model, overlap=False).generate(requests())

    def run(i: int):
        p = params(i)
        with SpecDecodeClient(overlap_stack.address) as client:
            return client.generate(PROMPTS[i], max_tokens=p.max_tokens,
                                   temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                                   num_speculative_tokens=[None, 1, 2][i % 3]).token_ids
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(run, range(8)))
    assert got == [want[f"r{i}"].output_token_ids for i in range(8)]
