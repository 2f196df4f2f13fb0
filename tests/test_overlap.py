"""Overlap: two groups of sequences alternate between proposer and scorer; every sequence
sees exactly the tokens it would see without overlap, in-process and through the stack."""

from __future__ import annotations

import concurrent.futures

import pytest

from specdecode.api.client import SpecDecodeClient
from orchestrator.engine.request import Request
from orchestrator.engine.core import SpecDecodeEngine
from specdecode.sequence import SamplingParams
from specdecode_stack.local import LocalStack, StackConfig
from tests.conftest import make_engine, reference_greedy

PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], [7, 8, 9, 7, 8, 9, 7, 8],
           [200, 100, 50], [9] * 20, [3, 1, 4, 1, 5, 9, 2, 6], [11, 22, 33, 44, 55]]


def params(i: int, max_tokens: int = 20) -> SamplingParams:
    """Even rows greedy, odd rows seeded top-p sampling."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens)
    return SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=max_tokens)


def engines(target, draft, overlap: bool) -> SpecDecodeEngine:
    base = make_engine(target, draft, "batch-expansion", 3)
    return SpecDecodeEngine(base.proposer, base.scorer, max_model_len=base.max_model_len,
                            num_speculative_tokens=3,
                            overlap=overlap)


def requests() -> list[Request]:
    # Per-request k differs (None = the engine's 3): groups must not change any sequence's k.
    return [Request(f"r{i}", p, params(i), num_speculative_tokens=[None, 1, 2][i % 3])
            for i, p in enumerate(PROMPTS)]


def test_overlap_gives_each_sequence_the_same_tokens(target_model, draft_model):
    want = engines(target_model, draft_model, overlap=False).generate(requests())
    engine = engines(target_model, draft_model, overlap=True)
    for r in requests():
        engine.add_request(r)
    batch_sizes, done = [], {}
    while engine.has_unfinished():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
        batch_sizes.append(engine.last_step.batch_size)
    assert max(batch_sizes) == 4  # two groups of 4 alternate
    assert done == {rid: seq.output_token_ids for rid, seq in want.items()}
    for i, prompt in enumerate(PROMPTS[::2]):
        assert done[f"r{2 * i}"] == reference_greedy(target_model, prompt, 20)
    assert engine.proposer.worker.runner.num_cached_sequences == 0
    assert engine.scorer.worker.runner.num_cached_sequences == 0


def test_cancel_while_proposals_are_in_flight_releases_after_the_call(target_model, draft_model):
    engine = engines(target_model, draft_model, overlap=True)
    for r in requests()[:4]:
        engine.add_request(r)
    engine.step()  # verifies r0, r1; proposals for r2, r3 are in flight
    assert engine.pipeline.in_flight(engine.running["r3"])
    engine.abort("r3")
    while engine.has_unfinished():
        engine.step()
    # r3's proposals were computed after the abort; its release came after them, so
    # nothing of it stays behind on either side.
    assert engine.proposer.worker.runner.num_cached_sequences == 0
    assert engine.scorer.worker.runner.num_cached_sequences == 0


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
