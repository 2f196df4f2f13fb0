"""How a sample ended, in each API's words; the one place that converts between them.

Inside the orchestrator and in its Python client: "stop" | "length" | "cancelled". On the
wire: the FinishReason enum. Over the OpenAI-compatible HTTP API: OpenAI's words, where a
server-side cancel is vLLM's "abort"."""

from __future__ import annotations

from specdecode.v1 import spec_decode_service_pb2 as pb

_PROTO = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
          "cancelled": pb.FINISH_REASON_CANCELLED}
_NAMES = {value: name for name, value in _PROTO.items()}


def to_proto(reason: str) -> int:
    return _PROTO[reason]


def from_proto(value: int) -> str:
    """The name of a FinishReason; "unknown" for a value this client does not know."""
    return _NAMES.get(value, "unknown")


def to_openai(reason: str | None) -> str | None:
    return {"cancelled": "abort"}.get(reason, reason) if reason else None
