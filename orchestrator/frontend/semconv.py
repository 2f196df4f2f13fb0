"""OpenTelemetry GenAI semantic conventions (Development status; semantic-conventions v1.41
and its successor, semantic-conventions-genai) for the request span and the gen_ai.server.*
metrics: the span is named `{gen_ai.operation.name} {gen_ai.request.model}`, carries what
was asked (at the start) and what came back (at the end), beside the `specdecode.*`
attributes. docs/observability.md lists them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdecode.errors import status_of
from specdecode.sequence import SamplingParams

PROVIDER = "specdecode"  # gen_ai.provider.name: no well-known value applies to this server
CHAT, TEXT_COMPLETION = "chat", "text_completion"  # gen_ai.operation.name


@dataclass(frozen=True)
class Operation:
    """How a request came in, as the conventions describe it."""

    name: str = TEXT_COMPLETION  # gen_ai.operation.name
    api: str = "grpc"  # "grpc" | "http": error.type is that API's status
    stream: bool = True  # gen_ai.request.stream (gRPC Generate always streams)
    response_id_prefix: str = ""  # gen_ai.response.id: this + the request id ("chatcmpl-")

    def response_id(self, request_id: str) -> str:
        return self.response_id_prefix + request_id

    def span_name(self, model: str) -> str:
        return f"{self.name} {model}"

    def error_type(self, error: BaseException | None, reason: str) -> str | None:
        """error.type of a request that failed (its API's status: `INVALID_ARGUMENT`, `503`)
        or was cancelled; None for one that finished."""
        if error is not None:
            status = status_of(error)
            return status.grpc_code.name if self.api == "grpc" else str(status.http_status)
        return "cancelled" if reason == "cancelled" else None


def metric_attributes(op: Operation, model: str) -> dict[str, Any]:
    """The attributes the span and every gen_ai.server.* metric share. The request names the
    served model or none, and the served model answers: request and response model agree."""
    return {"gen_ai.operation.name": op.name, "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": model, "gen_ai.response.model": model}


def request_attributes(op: Operation, model: str, params: SamplingParams, n: int,
                       stop: list[str], request_id: str) -> dict[str, Any]:
    """gen_ai.request.*: the model and the sampling controls the request asked for."""
    attrs = {**metric_attributes(op, model), "gen_ai.output.type": "text",
             "gen_ai.request.stream": op.stream,
             "gen_ai.response.id": op.response_id(request_id),
             "gen_ai.request.max_tokens": params.max_tokens,
             "gen_ai.request.temperature": params.temperature,
             "gen_ai.request.top_p": params.top_p}
    if n != 1:
        attrs["gen_ai.request.choice.count"] = n
    if stop:
        attrs["gen_ai.request.stop_sequences"] = list(stop)
    if params.top_k:
        attrs["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = params.seed
    if params.presence_penalty:
        attrs["gen_ai.request.presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        attrs["gen_ai.request.frequency_penalty"] = params.frequency_penalty
    return attrs


def response_attributes(prompt_tokens: int, output_tokens: int,
                        finish_reasons: list[str]) -> dict[str, Any]:
    """gen_ai.usage.* (summed over the choices) and one finish reason per choice."""
    return {"gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.response.finish_reasons": finish_reasons}
