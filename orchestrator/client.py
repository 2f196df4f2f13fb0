"""A small Python client for the public SpecDecodeService API.

    with SpecDecodeClient("127.0.0.1:50051") as client:
        for delta in client.stream("def fib(n):", max_tokens=32):
            print(delta.text, end="")
        result = client.generate([1, 2, 3], max_tokens=8)  # token-id prompt
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from specdecode.v1 import spec_decode_service_pb2 as pb
from specdecode.v1 import spec_decode_service_pb2_grpc

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_CANCELLED: "cancelled"}


@dataclass
class GenerateResult:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        usage = {k: (None if isinstance(v, float) and math.isnan(v) else v)
                 for k, v in self.usage.items()}
        return {"text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "usage": usage}


def build_request(prompt: str | list[int], *, max_tokens: int = 0, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 0.0, seed: int | None = None,
                  stop: list[str] = (), stop_token_ids: list[int] = (),
                  num_speculative_tokens: int | None = None,
                  request_id: str = "") -> pb.GenerateRequest:
    request = pb.GenerateRequest(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                 top_p=top_p, seed=seed, stop=list(stop),
                                 stop_token_ids=list(stop_token_ids),
                                 num_speculative_tokens=num_speculative_tokens,
                                 request_id=request_id)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


class SpecDecodeClient:
    def __init__(self, address: str, timeout_s: float | None = None):
        self.channel = grpc.insecure_channel(address)
        self.stub = spec_decode_service_pb2_grpc.SpecDecodeServiceStub(self.channel)
        self.timeout_s = timeout_s

    def __enter__(self) -> SpecDecodeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(self, prompt: str | list[int], **params) -> Iterator[pb.GenerateResponse]:
        """The raw response stream; raises grpc.RpcError on a non-OK status."""
        return self.stub.Generate(build_request(prompt, **params), timeout=self.timeout_s)

    def generate(self, prompt: str | list[int], **params) -> GenerateResult:
        result = GenerateResult()
        for response in self.stream(prompt, **params):
            accumulate(result, response)
        return result


def accumulate(result: GenerateResult, response: pb.GenerateResponse) -> None:
    result.request_id = response.request_id
    result.text += response.text
    result.token_ids += list(response.token_ids)
    if response.finish_reason:
        result.finish_reason = FINISH_NAMES.get(response.finish_reason, "unknown")
        u = response.usage
        result.usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                        "draft_tokens": u.draft_tokens, "accepted_tokens": u.accepted_tokens,
                        "emitted_tokens": u.emitted_tokens, "acceptance_rate": u.acceptance_rate,
                        "steps": u.steps}
