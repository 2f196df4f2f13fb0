"""Back-pressure in-process (orchestrator.engine.outbox): an outbox counts what its client
has not taken; a sequence whose outbox is full is left out of steps (its output unchanged
once it resumes); the engine loop sleeps when only paused sequences are left and a take
wakes it; the stream watch fires only after outputs waited, untaken, for its timeout."""

from __future__ import annotations

import asyncio
import queue
import time

import pytest

from orchestrator.engine.loop import EngineLoop
from orchestrator.engine.outbox import Outbox
from orchestrator.engine.request import StepOutput
from orchestrator.frontend.stream_watch import StreamWatch
from tests.support.models import greedy_request, make_engine

PROMPT = [5, 17, 99, 3]


def test_outbox_counts_untaken_outputs_and_wakes_when_it_unfills():
    woken = []
    box = Outbox(2, lambda: woken.append(1))
    assert not box.full and box.stalled_for() == 0
    box.put()
    assert not box.full and box.stalled_for(now=10**9) > 0
    box.put()
    assert box.full and box.waiting == 2
    box.take()
    assert not box.full and woken == [1]
    box.take()
    assert box.stalled_for() == 0 and woken == [1]  # it was not full: no wake
    with pytest.raises(ValueError):
        Outbox(0)


def test_a_paused_sequence_is_not_scheduled_and_resumes_with_the_same_output(target_model,
                                                                           draft_model):
    reference = make_engine(target_model, draft_model, "batch-expansion", 3).generate(
        [greedy_request("a", PROMPT, 40)])["a"].output_token_ids
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)
    box = Outbox(1)
    engine.add_request(greedy_request("a", PROMPT, 40, outbox=box))
    engine.add_request(greedy_request("b", [1, 2, 3], 40))
    tokens = [t for o in engine.step() if o.request_id == "a" for t in o.new_token_ids]
    box.put()  # one output untaken: "a" pauses
    assert engine.running["a"].paused
    for _ in range(3):
        assert [o.request_id for o in engine.step()] == ["b"]
    assert len(engine.running["a"].output_token_ids) == len(tokens)
    box.take()
    while "a" in engine.running:
        tokens += [t for o in engine.step() if o.request_id == "a" for t in o.new_token_ids]
    assert tokens == reference


def test_an_engine_with_only_paused_sequences_has_no_work(target_model, draft_model):
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)
    box = Outbox(1)
    engine.add_request(greedy_request("a", PROMPT, 40, outbox=box))
    assert engine.has_unfinished()
    box.put()
    assert not engine.has_unfinished() and engine.step() == []
    box.take()
    assert engine.has_unfinished()


def test_the_loop_sleeps_on_paused_sequences_and_a_take_wakes_it(target_model, draft_model):
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)
    loop = EngineLoop(engine)
    box = Outbox(1, loop.wake)
    outputs: queue.Queue[StepOutput] = queue.Queue()

    def sink(item):
        box.put()
        outputs.put(item)
    loop.start()
    try:
        loop.submit(greedy_request("a", PROMPT, 30, outbox=box), sink)
        first = outputs.get(timeout=60)
        steps = engine.steps
        assert loop.paused == 1
        time.sleep(0.3)
        assert outputs.empty() and engine.steps == steps  # asleep: no step, no output
        tokens = list(first.new_token_ids)
        finish = first.finish_reason
        while not finish:
            box.take()  # wakes the loop for one more step
            out = outputs.get(timeout=60)
            tokens += out.new_token_ids
            finish = out.finish_reason
        assert len(tokens) == 30 and finish == "length"
    finally:
        loop.stop()


def test_stream_watch_fires_only_after_outputs_waited_untaken():
    async def scenario() -> tuple[bool, bool]:
        box, fired = Outbox(4), asyncio.Event()
        watch = StreamWatch(box, 0.2, fired.set).start()
        await asyncio.sleep(0.5)
        idle = fired.is_set()  # nothing waited: no stall however long
        box.put()
        await asyncio.wait_for(fired.wait(), 30)
        watch.close()
        return idle, watch.expired
    idle, expired = asyncio.run(scenario())
    assert not idle and expired
