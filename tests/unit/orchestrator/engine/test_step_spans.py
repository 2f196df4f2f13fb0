"""The engine's spans: step spans in the request's trace, step-span sampling
(--trace-steps), links for shared steps, failed steps recorded."""

from __future__ import annotations

import logging
import math
import time

import pytest
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from specdecode.telemetry import logs, tracing
from tests.support.models import greedy_request, make_engine


def test_parse_trace_steps():
    assert tracing.parse_trace_steps("all") == 1
    assert tracing.parse_trace_steps("none") == 0
    assert tracing.parse_trace_steps("5") == 5
    assert tracing.parse_trace_steps(0) == 0
    for bad in ("-1", "some"):
        with pytest.raises(ValueError):
            tracing.parse_trace_steps(bad)


def traced_requests(prompts, max_tokens=16):
    spans, requests = [], []
    for i, prompt in enumerate(prompts):
        span = tracing.RequestSpan("spec_decode.request", {"specdecode.request_id": f"r{i}"})
        request = greedy_request(f"r{i}", prompt, max_tokens)
        request.trace_context = span.context
        spans.append(span)
        requests.append(request)
    return spans, requests


def run_engine(target_model, draft_model, trace_every, prompts=([5, 17, 99, 3],), max_tokens=16):
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)
    engine.trace_every = trace_every
    spans, requests = traced_requests(prompts, max_tokens)
    done = engine.generate(requests)
    for span in spans:
        span.end()
    return engine, done


def by_name(spans, name):
    return [s for s in spans if s.name == name]


def test_step_spans_sit_in_the_request_trace(exporter, target_model, draft_model):
    engine, done = run_engine(target_model, draft_model, trace_every=1)
    spans = exporter.get_finished_spans()
    (request,) = by_name(spans, "spec_decode.request")
    steps = by_name(spans, "spec_decode.step")
    assert len(steps) == engine.steps == done["r0"].stats.steps
    assert {s.context.trace_id for s in spans} == {request.context.trace_id}
    assert all(s.parent.span_id == request.context.span_id for s in steps)
    step_ids = {s.context.span_id for s in steps}
    for name in ("propose", "score", "rejection_sample"):
        children = by_name(spans, name)
        # The prompt's step has nothing to propose: no proposer call, no propose span.
        expected = len(steps) - (name == "propose")
        assert len(children) == expected and all(c.parent.span_id in step_ids for c in children)
    assert sum(s.attributes["specdecode.accepted_tokens"] for s in steps) >= \
        done["r0"].stats.accepted_tokens  # vLLM 0.4.2's count >= the prefixes received
    assert sum(s.attributes["specdecode.draft_tokens"] for s in steps) == \
        done["r0"].stats.draft_tokens
    assert sum(s.attributes["specdecode.new_tokens"] for s in steps) == 16


@pytest.mark.parametrize("every", [0, 3])
def test_step_sampling_drops_step_spans_and_their_children(exporter, target_model, draft_model,
                                                           every):
    engine, done = run_engine(target_model, draft_model, trace_every=every)
    spans = exporter.get_finished_spans()
    kept = 0 if every == 0 else math.ceil(engine.steps / every)
    assert len(by_name(spans, "spec_decode.step")) == kept
    for name in ("propose", "score", "rejection_sample", "batch_expansion.expand",
                 "target_model.forward", "batch_expansion.contract"):
        # Step 0 (always kept when any is) is the prompt's: it makes no proposer call.
        assert len(by_name(spans, name)) == (max(kept - 1, 0) if name == "propose" else kept)
    assert len(by_name(spans, "spec_decode.request")) == 1
    # Nothing from an untraced step: every other span descends from a kept step span.
    parents = {s.context.span_id: s for s in spans}
    for span in spans:
        while span.name not in ("spec_decode.step", "spec_decode.request"):
            span = parents[span.parent.span_id]
    assert len(by_name(spans, "draft_model.forward")) <= 3 * kept


def test_a_shared_step_links_the_other_requests(exporter, target_model, draft_model):
    engine, done = run_engine(target_model, draft_model, 1, prompts=([5, 17, 99, 3], [42], [9] * 5))
    spans = exporter.get_finished_spans()
    requests = {s.attributes["specdecode.request_id"]: s
                for s in by_name(spans, "spec_decode.request")}
    first = by_name(spans, "spec_decode.step")[0]
    assert first.attributes["specdecode.batch_size"] == 3
    assert first.parent.span_id == requests["r0"].context.span_id  # the oldest request
    assert list(first.attributes["specdecode.request_ids"]) == ["r0", "r1", "r2"]
    assert {link.context.span_id for link in first.links} == \
        {requests["r1"].context.span_id, requests["r2"].context.span_id}


def test_unsampled_requests_make_no_step_spans(exporter, target_model, draft_model):
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)
    request = greedy_request("r0", [5, 17, 99, 3], 8)
    sc = trace.SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=trace.TraceFlags(0))
    request.trace_context = trace.set_span_in_context(trace.NonRecordingSpan(sc))
    engine.generate([request])
    assert exporter.get_finished_spans() == ()


def test_a_failed_step_records_the_error(exporter, target_model, draft_model):
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)

    def broken(*args, **kwargs):  # the prompt's step calls the scorer only
        raise RuntimeError("scorer is gone")
    engine.scorer.score_proposals = broken
    spans, requests = traced_requests([[5, 17, 99, 3]])
    engine.add_request(requests[0])
    with pytest.raises(RuntimeError):
        engine.step()
    (step,) = by_name(exporter.get_finished_spans(), "spec_decode.step")
    (score,) = by_name(exporter.get_finished_spans(), "score")
    for span in (step, score):
        assert span.status.status_code == StatusCode.ERROR
        assert any(e.name == "exception" and "scorer is gone" in e.attributes["exception.message"]
                   for e in span.events)


def test_a_failed_step_is_logged_in_the_request_trace(exporter, target_model, draft_model):
    from orchestrator.engine.loop import EngineLoop
    engine = make_engine(target_model, draft_model, "batch-expansion", 3)

    def broken(*args, **kwargs):  # the prompt's step calls the scorer only
        raise RuntimeError("scorer is gone")
    engine.scorer.score_proposals = broken
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.addFilter(logs.TraceContextFilter())
    handler.emit = records.append
    logging.getLogger("orchestrator.engine.loop").addHandler(handler)
    spans, requests = traced_requests([[5, 17, 99, 3]])
    loop, results = EngineLoop(engine), []
    loop.start()
    try:
        loop.submit(requests[0], results.append)
        for _ in range(200):
            if results:
                break
            time.sleep(0.01)
    finally:
        loop.stop()
        logging.getLogger("orchestrator.engine.loop").removeHandler(handler)
    assert isinstance(results[0], RuntimeError)
    (failed,) = [r for r in records if r.getMessage().startswith("step failed")]
    assert failed.trace_id == format(spans[0].span.get_span_context().trace_id, "032x")


def test_tracing_off_engine_makes_no_spans(target_model, draft_model):
    assert not tracing.enabled()
    engine, done = run_engine(target_model, draft_model, trace_every=1, max_tokens=4)
    assert done["r0"].stats.steps  # ran, with nothing to export to
