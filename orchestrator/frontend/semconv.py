"""OpenTelemetry GenAI semantic conventions for the request span: what was asked (at the
start) and what came back (at the end), beside the `specdecode.*` attributes."""

from __future__ import annotations

from typing import Any

from specdecode.sequence import SamplingParams

OPERATION = "text_completion"  # gen_ai.operation.name: a prompt in, a completion out


def request_attributes(model: str, params: SamplingParams) -> dict[str, Any]:
    """gen_ai.request.*: the model and the sampling controls the request asked for."""
    attrs = {"gen_ai.operation.name": OPERATION, "gen_ai.request.model": model,
             "gen_ai.request.max_tokens": params.max_tokens,
             "gen_ai.request.temperature": params.temperature,
             "gen_ai.request.top_p": params.top_p}
    if params.top_k:
        attrs["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = params.seed
    return attrs


def response_attributes(prompt_tokens: int, output_tokens: int, finish_reason: str,
                        ttft_s: float | None, seconds: float) -> dict[str, Any]:
    """gen_ai.usage.* and gen_ai.response.finish_reasons, with the time to the first token
    and the time per output token after it (seconds; absent when not measurable)."""
    attrs = {"gen_ai.usage.input_tokens": prompt_tokens,
             "gen_ai.usage.output_tokens": output_tokens,
             "gen_ai.response.finish_reasons": [finish_reason]}
    if ttft_s is not None:
        attrs["gen_ai.server.time_to_first_token"] = ttft_s
        if output_tokens > 1:
            attrs["gen_ai.server.time_per_output_token"] = (seconds - ttft_s) / (output_tokens - 1)
    return attrs
