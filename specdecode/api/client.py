"""Python clients for the public SpecDecodeService API: blocking and asyncio.

    with SpecDecodeClient("127.0.0.1:50051") as client:
        for delta in client.stream("def fib(n):", max_tokens=32):
            print(delta.text, end="")
        result = client.generate([1, 2, 3], max_tokens=8, logprobs=2)  # token-id prompt
        print(result.usage.acceptance_rate, result.logprobs[0].top_logprobs)

    async with AsyncSpecDecodeClient("127.0.0.1:50051") as client:
        results = await client.samples("Once upon a time", n=3, temperature=0.8, seed=1)

These modules ship with the package as `specdecode.v1`; Python clients import them from
the installed package rather than generating their own (see the README on generating
stubs for other languages or a separate Python package).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from specdecode.api import finish_reason
from specdecode.api.usage import Usage, usage_from_proto
from specdecode.v1 import model_info_pb2
from specdecode.serving.auth import bearer_metadata
from specdecode.serving.tls import TlsFiles, channel_credentials
from specdecode.v1 import spec_decode_service_pb2 as pb
from specdecode.v1 import spec_decode_service_pb2_grpc
from specdecode.v1.structured_output_pb2 import StructuredOutput

@dataclass
class GenerateResult:
    """One sample's whole output."""

    request_id: str = ""
    index: int = 0  # which of the request's n samples
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    usage: Usage | None = None
    # One per token when the request set `logprobs`: token_id, logprob, top_logprobs.
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)

    def as_json(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids,
               "finish_reason": self.finish_reason,
               "usage": self.usage.as_json() if self.usage else None}
        if self.logprobs:
            out["logprobs"] = [{"token_id": e.token_id, "logprob": e.logprob,
                                "top_logprobs": [{"token_id": t.token_id, "logprob": t.logprob}
                                                 for t in e.top_logprobs]}
                               for e in self.logprobs]
        return out


def build_request(prompt: str | list[int], *, max_tokens: int = 0, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 0.0, min_p: float = 0.0,
                  repetition_penalty: float = 0.0, presence_penalty: float = 0.0,
                  frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None,
                  seed: int | None = None, stop: Iterable[str] = (),
                  stop_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                  logprobs: int | None = None, n: int = 0,
                  num_speculative_tokens: int | None = None,
                  request_id: str = "",
                  structured_output: StructuredOutput | None = None) -> pb.GenerateRequest:
    """A GenerateRequest; 0 leaves max_tokens, top_p, repetition_penalty and n at the
    server's defaults (256 or --default-max-tokens, 1.0, 1.0, 1). structured_output: e.g.
    StructuredOutput(regex="[0-9]+") or StructuredOutput(json_schema=json.dumps(schema))."""
    request = pb.GenerateRequest(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logit_bias=logit_bias or {}, seed=seed,
        stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
        logprobs=logprobs, n=n, num_speculative_tokens=num_speculative_tokens,
        request_id=request_id, structured_output=structured_output)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def accumulate(result: GenerateResult, response: pb.GenerateResponse) -> None:
    """Add one response message (of result's sample) to the result."""
    result.request_id = response.request_id
    result.index = response.index
    result.text += response.text
    result.token_ids += list(response.token_ids)
    result.logprobs += list(response.logprobs)
    if response.finish_reason:
        result.finish_reason = finish_reason.from_proto(response.finish_reason)
        result.usage = usage_from_proto(response.usage)


def _by_index(results: dict[int, GenerateResult], response: pb.GenerateResponse) -> None:
    accumulate(results.setdefault(response.index, GenerateResult()), response)


def _one(results: dict[int, GenerateResult]) -> GenerateResult:
    return results.get(0, GenerateResult())


class SpecDecodeClient:
    """Blocking client; raises grpc.RpcError on a non-OK status. tls_ca: connect over TLS,
    trusting this CA's PEM file ("" = the system roots; None = plaintext); tls_cert/tls_key:
    a client certificate, for a server that asks for one; token: sent as
    `authorization: Bearer <token>`."""

    def __init__(self, address: str, timeout_s: float | None = None, *,
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, token: str | None = None):
        if tls_ca is None and tls_cert is None:
            self.channel = grpc.insecure_channel(address)
        else:
            self.channel = grpc.secure_channel(
                address, channel_credentials(TlsFiles(tls_cert, tls_key, tls_ca or None)))
        self.metadata = bearer_metadata(token)
        self.stub = spec_decode_service_pb2_grpc.SpecDecodeServiceStub(self.channel)
        self.timeout_s = timeout_s

    def __enter__(self) -> SpecDecodeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def model_info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(model_info_pb2.GetModelInfoRequest(), timeout=self.timeout_s,
                                      metadata=self.metadata)

    def stream(self, prompt: str | list[int], **params) -> Iterator[pb.GenerateResponse]:
        """The raw response stream (parameters as `build_request`)."""
        return self.stub.Generate(build_request(prompt, **params), timeout=self.timeout_s,
                                  metadata=self.metadata)

    def samples(self, prompt: str | list[int], **params) -> list[GenerateResult]:
        """Every sample of the request (n of them), by index."""
        results: dict[int, GenerateResult] = {}
        for response in self.stream(prompt, **params):
            _by_index(results, response)
        return [results[i] for i in sorted(results)]

    def generate(self, prompt: str | list[int], **params) -> GenerateResult:
        """The whole output of a one-sample request."""
        results: dict[int, GenerateResult] = {}
        for response in self.stream(prompt, **params):
            _by_index(results, response)
        return _one(results)


class AsyncSpecDecodeClient:
    """asyncio client (grpc.aio); raises grpc.aio.AioRpcError on a non-OK status."""

    def __init__(self, address: str, timeout_s: float | None = None):
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = spec_decode_service_pb2_grpc.SpecDecodeServiceStub(self.channel)
        self.timeout_s = timeout_s

    async def __aenter__(self) -> AsyncSpecDecodeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def model_info(self) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(model_info_pb2.GetModelInfoRequest(),
                                            timeout=self.timeout_s)

    async def stream(self, prompt: str | list[int], **params) -> AsyncIterator[pb.GenerateResponse]:
        """The raw response stream; leaving the loop early cancels the call."""
        call = self.stub.Generate(build_request(prompt, **params), timeout=self.timeout_s)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def samples(self, prompt: str | list[int], **params) -> list[GenerateResult]:
        results: dict[int, GenerateResult] = {}
        async for response in self.stream(prompt, **params):
            _by_index(results, response)
        return [results[i] for i in sorted(results)]

    async def generate(self, prompt: str | list[int], **params) -> GenerateResult:
        results: dict[int, GenerateResult] = {}
        async for response in self.stream(prompt, **params):
            _by_index(results, response)
        return _one(results)
