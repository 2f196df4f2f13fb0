"""Lossless greedy decoding (docs/design.md, invariant 1): spec-decode output equals the target
model's own greedy decoding token for token, in float32."""

from __future__ import annotations

import threading

import pytest

from orchestrator.engine.loop import EngineLoop

from tests.support.models import greedy_request, make_engine
from tests.support.references import reference_greedy

# Four prompts of different lengths; the repetitive one gives n-gram proposals that match.
PROMPTS = [
    [5, 17, 99, 3],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    [42],
    [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8],
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def expected(target_model):
    return [reference_greedy(target_model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("scoring", ["batch-expansion", "multi-query"])
@pytest.mark.parametrize("proposer", ["draft", "ngram", "self"])
def test_greedy_equals_target(target_model, draft_model, expected, proposer, scoring, k):
    draft = {"draft": draft_model, "ngram": "ngram", "self": target_model}[proposer]
    engine = make_engine(target_model, draft, scoring, k)
    done = engine.generate([greedy_request(str(i), p, MAX_TOKENS) for i, p in enumerate(PROMPTS)])
    for i, want in enumerate(expected):
        assert done[str(i)].output_token_ids == want, (proposer, scoring, k, i)
        assert done[str(i)].finish_reason == "length"
    stats = [done[str(i)].stats for i in range(len(PROMPTS))]
    assert sum(s.draft_tokens for s in stats) > 0
    if proposer == "self":
        # Draft = target: every proposal is accepted, so each speculative step emits k+1
        # tokens (fewer only when max_tokens or the model length cuts a step short).
        assert all(s.accepted_tokens == s.draft_tokens for s in stats)
        assert all(s.steps <= 1 + -(-(MAX_TOKENS - 1) // (k + 1)) for s in stats)


def test_mixed_batch_speculating_and_not(target_model, draft_model, expected):
    """Requests with speculation off (k=0) and on share steps; all stay exact."""
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)
    requests = [greedy_request(str(i), p, MAX_TOKENS, num_speculative_tokens=0 if i % 2 else None)
                for i, p in enumerate(PROMPTS)]
    done = engine.generate(requests)
    for i, want in enumerate(expected):
        assert done[str(i)].output_token_ids == want
        assert (done[str(i)].stats.draft_tokens == 0) == bool(i % 2)


def test_late_joiner_and_stop_token(target_model, draft_model, expected):
    """A request added mid-run joins the next step; a stop token ends a sequence early."""
    engine = make_engine(target_model, draft_model, "multi-query", 4)
    engine.add_request(greedy_request("a", PROMPTS[0], MAX_TOKENS))
    engine.step()
    engine.step()
    stop = expected[1][5]
    late = greedy_request("b", PROMPTS[1], MAX_TOKENS)
    late.sampling_params.stop_token_ids = (stop,)
    engine.add_request(late)
    seqs = dict(engine.running)
    while engine.has_unfinished():
        engine.step()
    assert seqs["a"].output_token_ids == expected[0]
    b = seqs["b"]
    assert b.finish_reason == "stop"
    assert b.output_token_ids == expected[1][:expected[1].index(stop) + 1]


def test_max_model_len_stops_generation(target_model):
    engine = make_engine(target_model, target_model, "batch-expansion", 4)
    max_len = target_model.config.max_position_embeddings
    prompt = [3] * (max_len - 6)
    done = engine.generate([greedy_request("x", prompt, 50)])
    assert len(prompt) + len(done["x"].output_token_ids) == max_len
    assert done["x"].output_token_ids == reference_greedy(target_model, prompt, 6)
    assert done["x"].finish_reason == "length"


def test_a_queued_request_runs_when_the_running_ones_finish_in_one_step(target_model,
                                                                      draft_model, expected):
    """EngineLoop with max_running=2 and three identical requests: two run, one waits for a
    slot. The two finish in the same step; the queued one must still run (the loop used to
    wait for new commands with it queued, and it waited for good)."""
    loop = EngineLoop(make_engine(target_model, draft_model, "multi-query", 3), max_running=2)
    tokens: dict[str, list[int]] = {}
    done = threading.Semaphore(0)

    def sink_for(rid: str):
        def sink(out) -> None:
            assert not isinstance(out, BaseException), out
            tokens.setdefault(rid, []).extend(out.new_token_ids)
            if out.finish_reason:
                done.release()
        return sink

    for rid in ("a", "b", "c"):  # all submitted before the loop starts: one round admits two
        loop.submit(greedy_request(rid, PROMPTS[0], MAX_TOKENS), sink_for(rid))
    loop.start()
    try:
        finished = sum(done.acquire(timeout=20) for _ in range(3))
    finally:
        loop.stop()
    assert finished == 3, f"{finished} of 3 requests finished; tokens so far {tokens}"
    assert tokens == {rid: expected[0] for rid in "abc"}
