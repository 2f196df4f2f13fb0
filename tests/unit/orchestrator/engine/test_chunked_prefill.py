"""Chunked prefill: a long prompt is computed across steps within the per-step token
budget, so streams already running keep their pace, and every output stays the target's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from orchestrator.engine.prefill_pacing import MIN_CHUNK, PrefillPacer
from orchestrator.engine.request import Sequence
from orchestrator.engine.scheduler import plan_step
from tests.support.models import greedy_request, make_engine
from tests.support.references import reference_greedy


def _seq(i: int, prompt_len: int, output: int = 0, prefilled: int = 0) -> Sequence:
    s = Sequence(i, greedy_request(str(i), [1] * prompt_len, 8))
    s.output_token_ids, s.prefilled = [2] * output, prefilled
    return s


def test_plan_gives_running_streams_their_tokens_and_prompts_the_rest():
    k_of = lambda s: 3  # noqa: E731
    running, long, short = _seq(0, 10, output=5), _seq(1, 1000), _seq(2, 20)
    # 1 running (k+1 = 4 tokens), then the long prompt's first chunk takes the other 252.
    assert [(s.seq_id, c) for s, c in plan_step([running, long, short], k_of, 256)] == \
        [(0, None), (1, 252)]
    long.prefilled = 252 * 3
    # Its last 244 tokens fit: it joins whole; the short prompt waits for the next step
    # (only 8 tokens are left, under the smallest chunk).
    assert [(s.seq_id, c) for s, c in plan_step([running, long, short], k_of, 256)] == \
        [(0, None), (1, None)]
    # Decoding never waits, even past the budget; the first prompt still gets a quarter.
    busy = [_seq(i, 10, output=5) for i in range(100)]
    plan = plan_step([*busy, long], k_of, 256)
    assert len(plan) == 101 and plan[-1] == (long, 252 * 3 + 64)
    assert plan_step([running, long], k_of, None) == [(running, None), (long, None)]
    # Paced (beside decoders only): the prompt gets the pace, however much budget is left.
    long.prefilled = 0
    assert plan_step([running, long], k_of, 256, paced=32) == [(running, None), (long, 32)]
    assert plan_step([long], k_of, 256, paced=32) == [(long, 256)]


def test_pacer_aims_a_prompt_step_at_twice_a_decode_step():
    pacer = PrefillPacer()
    assert pacer.cap() is None  # nothing to pace against yet
    for _ in range(5):
        pacer.observe(0.010, 0, decoding=1)  # decode steps: 10 ms
    assert pacer.cap() == 4 * MIN_CHUNK
    pacer.observe(0.050, 4 * MIN_CHUNK, decoding=1)  # 5x a decode step: shrinks, by half
    pacer.observe(0.015, 2 * MIN_CHUNK, decoding=1)  # cheap: grows (at most 2x a step)
    assert pacer.cap() == 4 * MIN_CHUNK
    pacer.observe(0.012, 5, decoding=1)  # a short prompt did not use the pace: kept
    assert pacer.cap() == 4 * MIN_CHUNK
    pacer.observe(0.040, 4 * MIN_CHUNK, decoding=1)  # 4x a decode step: shrinks, by half
    assert pacer.cap() == 2 * MIN_CHUNK
    pacer.observe(0.020, 2 * MIN_CHUNK, decoding=1)  # right on target: kept
    assert pacer.cap() == 2 * MIN_CHUNK
    pacer.observe(1.0, 2 * MIN_CHUNK, decoding=1)  # a stall never takes it below MIN_CHUNK
    pacer.observe(1.0, MIN_CHUNK, decoding=1)
    assert pacer.cap() == MIN_CHUNK
    pacer.observe(0.5, 4000, decoding=0)  # no decoder waited: nothing learned
    assert pacer.cap() == MIN_CHUNK and pacer.decode_step_s == pytest.approx(0.010)


@pytest.mark.parametrize("scoring", ["batch-expansion", "multi-query"])
def test_chunked_output_equals_target_in_process(long_models, scoring):
    target, draft, _ = long_models
    long = torch.randint(0, 256, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    short = [5, 17, 99, 3]
    engine = make_engine(target, draft, scoring, 3)
    engine.max_num_batched_tokens = 128
    done = engine.generate([greedy_request("a", short, 20), greedy_request("b", long, 8)])
    assert done["a"].output_token_ids == reference_greedy(target, short, 20)
    assert done["b"].output_token_ids == reference_greedy(target, long, 8)
    assert engine.steps > 1500 // 128  # the long prompt really went in chunks


@pytest.mark.parametrize("share_cores", [True, False])
def test_a_chunks_draft_call_runs_beside_scoring_only_on_cores_of_its_own(long_models,
                                                                           share_cores):
    """With nobody speculating, a prompt chunk still warms the draft's KV state: beside the
    step's scoring call (a thread) where the services have cores of their own, before it
    where they share them (two forwards on the same cores slow each other ~7x). Fails if
    the chunk's draft call runs beside scoring on shared cores, or never runs at all."""
    target, draft, _ = long_models
    engine = make_engine(target, draft, "batch-expansion", 3)
    engine.max_num_batched_tokens, engine.warming.share_cores = 128, share_cores
    calls = []  # (role, thread name, start, end)

    def recorded(role, fn):
        def call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                calls.append((role, threading.current_thread().name, start,
                              time.perf_counter()))
        return call

    engine.proposer.get_proposals = recorded("proposer", engine.proposer.get_proposals)
    engine.scorer.score_proposals = recorded("scorer", engine.scorer.score_proposals)
    long = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    done = engine.generate([greedy_request("a", [5, 17, 99, 3], 30, num_speculative_tokens=0),
                            greedy_request("b", long, 4, num_speculative_tokens=0)])
    assert done["b"].output_token_ids == reference_greedy(target, long, 4)
    drafts = [c for c in calls if c[0] == "proposer"]
    assert len(drafts) >= 600 // 128  # every chunk warmed the draft
    threads = {name for _, name, _, _ in drafts}
    if share_cores:
        assert threads == {threading.current_thread().name}
        scored = [c for c in calls if c[0] == "scorer"]
        assert not any(d[2] < s[3] and s[2] < d[3] for d in drafts for s in scored)
    else:
        assert all(name.startswith("draft-chunks") for name in threads)
