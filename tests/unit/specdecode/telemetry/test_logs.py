"""The log formats (specdecode/telemetry/logs.py): JSON lines and text, both carrying the trace and
span ids."""

from __future__ import annotations

import io
import json
import logging

from specdecode.telemetry import logs, tracing


def log_lines(fmt, emit) -> list[str]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs.TraceContextFilter())
    handler.setFormatter(logs.JsonFormatter("specdecode-test") if fmt == "json"
                         else logs.TextFormatter())
    logger = logging.getLogger("specdecode.test_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue().splitlines()


def test_json_logs_carry_trace_and_span_ids(exporter):
    def emit(logger):
        logger.info("outside")
        with tracing.tracer("t").start_as_current_span("work"):
            logger.info("inside %d", 1, extra={"fields": {"rate": float("nan"), "n": 2}})
            try:
                raise ValueError("boom")
            except ValueError:
                logger.exception("failed")
    outside, inside, failed = [json.loads(line) for line in log_lines("json", emit)]
    (span,) = exporter.get_finished_spans()
    assert "trace_id" not in outside and outside["message"] == "outside"
    assert outside["service"] == "specdecode-test" and outside["level"] == "INFO"
    assert inside["trace_id"] == format(span.context.trace_id, "032x")
    assert inside["span_id"] == format(span.context.span_id, "016x")
    assert inside["message"] == "inside 1" and inside["n"] == 2 and inside["rate"] == "nan"
    assert "ValueError: boom" in failed["exception"] and failed["level"] == "ERROR"


def test_text_logs_append_trace_ids(exporter):
    def emit(logger):
        with tracing.tracer("t").start_as_current_span("work"):
            logger.info("hello")
    (line,) = log_lines("text", emit)
    (span,) = exporter.get_finished_spans()
    assert line.endswith(f"hello trace_id={span.context.trace_id:032x} "
                         f"span_id={span.context.span_id:016x}")
