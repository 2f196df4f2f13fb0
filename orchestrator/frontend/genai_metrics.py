"""The OpenTelemetry GenAI server metrics, one observation per request each: OTLP
histograms through the OpenTelemetry metrics API (exported when an entry point installs an
SDK MeterProvider, specdecode.telemetry.otel_setup; no-ops otherwise). Their names have dots, which
Prometheus names cannot: the Prometheus side has its own (orchestrator.frontend
.request_metrics). Boundaries are the conventions' advisory ones."""

from __future__ import annotations

from typing import Any

from opentelemetry import metrics

_meter = metrics.get_meter("specdecode.orchestrator")

REQUEST_DURATION = _meter.create_histogram(
    "gen_ai.server.request.duration", unit="s",
    description="Generative AI server request duration such as time-to-last byte or last "
                "output token.",
    explicit_bucket_boundaries_advisory=[0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                                         5.12, 10.24, 20.48, 40.96, 81.92])
TIME_TO_FIRST_TOKEN = _meter.create_histogram(
    "gen_ai.server.time_to_first_token", unit="s",
    description="Time to generate first token for successful responses.",
    explicit_bucket_boundaries_advisory=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                         0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0])
TIME_PER_OUTPUT_TOKEN = _meter.create_histogram(
    "gen_ai.server.time_per_output_token", unit="s",
    description="Time per output token generated after the first token for successful "
                "responses.",
    explicit_bucket_boundaries_advisory=[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                                         0.5, 0.75, 1.0, 2.5])


def record(attributes: dict[str, Any], seconds: float, ttft_s: float | None,
           output_tokens: int, error_type: str | None) -> None:
    """One request's observations: its duration (with error.type when it failed or was
    cancelled); for a successful one its time to first token, and its time per output token
    after the first (more than one token)."""
    if error_type is not None:
        REQUEST_DURATION.record(seconds, {**attributes, "error.type": error_type})
        return
    REQUEST_DURATION.record(seconds, attributes)
    if ttft_s is not None:
        TIME_TO_FIRST_TOKEN.record(ttft_s, attributes)
        if output_tokens > 1:
            TIME_PER_OUTPUT_TOKEN.record((seconds - ttft_s) / (output_tokens - 1), attributes)
