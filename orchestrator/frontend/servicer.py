"""SpecDecodeService: the public streaming API, thin over the frontend."""

from __future__ import annotations

import contextlib
import time

import grpc

from orchestrator.engine.request import TokenLogprobs
from orchestrator.frontend import request_metrics as metrics
from orchestrator.frontend.admission import Admission
from orchestrator.frontend.generation import Frontend, ServedModel
from orchestrator.frontend.request import GenerationRequest, RequestLimits
from orchestrator.engine.loop import EngineLoop
from specdecode.grammar.compiler import GrammarCompiler
from specdecode.wire import codec
from specdecode.api import finish_reason
from specdecode.api.usage import usage_to_proto
from specdecode.errors import Overloaded
from specdecode.errors import InvalidRequestError
from specdecode.sequence import SamplingParams
from specdecode.serving.server import Deferred, map_errors, map_stream_errors
from specdecode.v1 import spec_decode_service_pb2 as pb
from specdecode.v1 import spec_decode_service_pb2_grpc


def request_from_proto(m: pb.GenerateRequest) -> GenerationRequest:
    """GenerateRequest -> GenerationRequest, proto3's zeros read as the documented defaults."""
    kind = m.WhichOneof("prompt")
    prompt = m.text if kind == "text" else list(m.token_ids.ids) if kind else []
    params = SamplingParams(
        temperature=m.temperature, top_k=m.top_k, top_p=m.top_p or 1.0, min_p=m.min_p,
        repetition_penalty=m.repetition_penalty or 1.0, presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty, logit_bias=dict(m.logit_bias),
        seed=m.seed if m.HasField("seed") else None, stop_token_ids=tuple(m.stop_token_ids),
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        structured_output=codec.structured_output_from_proto(m.structured_output))
    return GenerationRequest(
        prompt, params, max_tokens=m.max_tokens or None, n=m.n or 1, stop=list(m.stop),
        ignore_eos=m.ignore_eos,
        num_speculative_tokens=(m.num_speculative_tokens
                                if m.HasField("num_speculative_tokens") else None),
        request_id=m.request_id, prompt_field="prompt.text" if kind == "text" else "prompt")


def logprobs_to_proto(entries: list[TokenLogprobs]) -> list[pb.TokenLogprobs]:
    return [pb.TokenLogprobs(token_id=e.token_id, logprob=e.logprob,
                             top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp)
                                           for t, lp in e.top])
            for e in entries]


class SpecDecodeServicer(Deferred, spec_decode_service_pb2_grpc.SpecDecodeServiceServicer):
    """Serves after attach(loop=EngineLoop, tokenizer=tokenizer or None, info=ServedModel,
    limits=RequestLimits, grammars=GrammarCompiler or why there is none); the OpenAI HTTP
    API shares its `frontend`, with its limits and `admission` (the requests inside,
    running or queued, from both APIs together)."""

    info: ServedModel

    def __init__(self, admission: Admission, stream_write_timeout_s: float = 30.0):
        self.frontend = Frontend(admission, stream_write_timeout_s)

    def attach(self, loop: EngineLoop, tokenizer, info: ServedModel, limits: RequestLimits,
               grammars: GrammarCompiler | str = "no grammar compiler configured") -> None:
        self.frontend.attach(loop, tokenizer, info, limits, grammars)
        super().attach(info=info)

    @property
    def model_name(self) -> str:  # the metrics' model_name label
        return self.info.model_name

    @map_errors
    async def GetModelInfo(self, request, context):
        # max_speculative_tokens: the wire keeps it; a request may ask for up to the server's k
        served = {k: v for k, v in vars(self.info).items() if k != "target_model_name"}
        return pb.GetModelInfoResponse(**served,
                                       max_speculative_tokens=self.info.num_speculative_tokens)

    @map_stream_errors
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            slot = self.frontend.admit()
        except Overloaded as exc:
            context.set_trailing_metadata(
                (("retry-after-ms", str(int(exc.retry_after_s * 1000))),))
            raise
        with slot:
            try:
                gen = await self.frontend.prepare(request_from_proto(request))
            except InvalidRequestError:
                metrics.REQUESTS.labels("invalid").inc()
                raise
            remaining = context.time_remaining()
            if remaining is not None:  # the client's deadline bounds the internal calls too
                gen.deadline = time.monotonic() + remaining
            # watched: a client stalled past the stream write timeout frees its slot and
            # sequences at once, though this write waits on its flow-control window
            async with contextlib.aclosing(self.frontend.run(gen, slot, watch=True)) as deltas:
                async for delta in deltas:
                    response = pb.GenerateResponse(request_id=gen.request_id, text=delta.text,
                                                   token_ids=delta.token_ids, index=delta.index)
                    if delta.logprobs is not None:
                        response.logprobs.extend(logprobs_to_proto(delta.logprobs))
                    if delta.finish_reason:
                        response.finish_reason = finish_reason.to_proto(delta.finish_reason)
                        response.usage.CopyFrom(usage_to_proto(delta.usage))
                    yield response
