"""Overlap: two groups of sequences alternate between proposer and scorer; every sequence
sees exactly the tokens it would see without overlap."""

from __future__ import annotations

from tests.support.overlap import PROMPTS, engines, requests
from tests.support.references import reference_greedy


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
