"""SpecDecodeService: the public streaming API, thin over the engine loop."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from orchestrator.frontend import request_metrics as metrics
from specdecode.api import finish_reason
from orchestrator.frontend.admission import Admission, Overloaded, RequestLimits
from orchestrator.engine.core import TokenLogprobs
from orchestrator.engine.loop import EngineLoop
from orchestrator.engine.deadlines import DeadlinePassedError
from orchestrator.frontend.generation import Frontend, Generation, ServedModel
from orchestrator.engine.errors import ServiceUnavailableError
from specdecode.api.usage import usage_to_proto
from specdecode.sequence import InvalidRequestError
from specdecode.server import Deferred, grpc_status_of, map_errors
from specdecode.v1 import spec_decode_service_pb2 as pb
from specdecode.v1 import spec_decode_service_pb2_grpc

log = logging.getLogger(__name__)

def logprobs_to_proto(entries: list[TokenLogprobs]) -> list[pb.TokenLogprobs]:
    return [pb.TokenLogprobs(token_id=e.token_id, logprob=e.logprob,
                             top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp)
                                           for t, lp in e.top])
            for e in entries]


class SpecDecodeServicer(Deferred, spec_decode_service_pb2_grpc.SpecDecodeServiceServicer):
    """Serves after attach(loop=EngineLoop, tokenizer=tokenizer or None, info=ServedModel,
    limits=RequestLimits); the OpenAI HTTP API shares its `frontend`, with its limits and
    `admission` (the requests inside, running or queued, from both APIs together)."""

    info: ServedModel

    def __init__(self, default_max_tokens: int = 256, max_speculative_tokens: int = 16,
                 admission: Admission | None = None):
        self.frontend = Frontend(default_max_tokens, max_speculative_tokens,
                                 admission=admission)

    def attach(self, loop: EngineLoop, tokenizer, info: ServedModel,
               limits: RequestLimits | None = None) -> None:
        self.frontend.attach(loop, tokenizer, info.model_name, limits)
        super().attach(info=info)

    @property
    def model_name(self) -> str:  # the metrics' model_name label
        return self.info.model_name

    async def to_generation(self, m: pb.GenerateRequest) -> Generation:
        """GenerateRequest -> Generation; InvalidRequestError naming the field. Bounds that
        need no tokenizer come first; text is tokenized off the event loop."""
        kind = m.WhichOneof("prompt")
        k = m.num_speculative_tokens if m.HasField("num_speculative_tokens") else None
        self.frontend.check_fields(
            request_id=m.request_id, text=m.text if kind == "text" else None,
            num_token_ids=len(m.token_ids.ids) if kind == "token_ids" else 0,
            temperature=m.temperature, top_p=m.top_p, stop=list(m.stop),
            stop_token_ids=list(m.stop_token_ids), num_speculative_tokens=k)
        if kind == "text":
            prompt = await self.frontend.tokenize_off_loop(m.text)
        else:
            prompt = list(m.token_ids.ids) if kind else []
        return self.frontend.build(
            prompt, max_tokens=m.max_tokens, temperature=m.temperature, top_k=m.top_k,
            top_p=m.top_p or 1.0, min_p=m.min_p, repetition_penalty=m.repetition_penalty or 1.0,
            presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
            logit_bias=dict(m.logit_bias), seed=m.seed if m.HasField("seed") else None,
            stop=list(m.stop), stop_token_ids=list(m.stop_token_ids), ignore_eos=m.ignore_eos,
            logprobs=m.logprobs if m.HasField("logprobs") else None, n=m.n or 1,
            num_speculative_tokens=(m.num_speculative_tokens
                                    if m.HasField("num_speculative_tokens") else None),
            request_id=m.request_id)

    @map_errors
    async def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(**vars(self.info))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await self.require_loaded(context)
        try:
            slot = self.frontend.admit()
        except Overloaded as exc:
            context.set_trailing_metadata(
                (("retry-after-ms", str(int(exc.retry_after_s * 1000))),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        responses = self._generate(request, context)
        try:
            async for response in responses:
                yield response
        finally:
            await responses.aclose()
            slot.release()

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            gen = await self.to_generation(request)
        except InvalidRequestError as exc:
            metrics.REQUESTS.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        remaining = context.time_remaining()
        if remaining is not None:  # the client's deadline bounds the internal calls too
            gen.deadline = time.monotonic() + remaining
        stream = self.frontend.run(gen)
        try:
            async for delta in stream:
                response = pb.GenerateResponse(request_id=gen.request_id, text=delta.text,
                                               token_ids=delta.token_ids, index=delta.index)
                if delta.logprobs is not None:
                    response.logprobs.extend(logprobs_to_proto(delta.logprobs))
                if delta.finish_reason:
                    response.finish_reason = finish_reason.to_proto(delta.finish_reason)
                    response.usage.CopyFrom(usage_to_proto(delta.usage))
                yield response
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await context.abort(_status_for(exc), str(exc))
        finally:
            await stream.aclose()


def _status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, (grpc.RpcError, ServiceUnavailableError)):  # a service failed
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, DeadlinePassedError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc_status_of(exc)
