"""SpecDecodeService: the public streaming API, thin over the engine loop."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

import grpc

from orchestrator import metrics
from orchestrator.engine import Request, StepOutput
from orchestrator.engine_loop import EngineLoop
from orchestrator.deadlines import DeadlinePassedError
from orchestrator.replicas import ServiceUnavailableError
from orchestrator.text import TextStream
from specdecode import tracing
from specdecode.sequence import InvalidRequestError, SamplingParams
from specdecode.server import Deferred, grpc_status_of
from specdecode.v1 import spec_decode_service_pb2 as pb
from specdecode.v1 import spec_decode_service_pb2_grpc

log = logging.getLogger(__name__)

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
          "cancelled": pb.FINISH_REASON_CANCELLED}


def usage_of(prompt_tokens: int, completion_tokens: int, stats) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
                    emitted_tokens=stats.emitted_tokens, acceptance_rate=stats.acceptance_rate,
                    steps=stats.steps)


class SpecDecodeServicer(Deferred, spec_decode_service_pb2_grpc.SpecDecodeServiceServicer):
    """Serves after attach(loop=EngineLoop, tokenizer=tokenizer or None)."""

    loop: EngineLoop
    tokenizer = None

    def __init__(self, default_max_tokens: int = 256, max_speculative_tokens: int = 16):
        self.default_max_tokens = default_max_tokens
        self.max_speculative_tokens = max_speculative_tokens

    @property
    def engine(self):
        return self.loop.engine

    def to_request(self, m: pb.GenerateRequest) -> Request:
        """GenerateRequest -> engine Request; InvalidRequestError naming the field."""
        kind = m.WhichOneof("prompt")
        if kind == "text":
            if self.tokenizer is None:
                raise InvalidRequestError("prompt.text", "this server has no tokenizer; "
                                          "send prompt.token_ids")
            prompt = self.tokenizer(m.text).input_ids if m.text else []
        else:
            prompt = list(m.token_ids.ids) if kind else []
        if m.max_tokens < 0:
            raise InvalidRequestError("max_tokens", f"must be >= 0, got {m.max_tokens}")
        k = m.num_speculative_tokens if m.HasField("num_speculative_tokens") else None
        if k is not None and not 0 <= k <= self.max_speculative_tokens:
            raise InvalidRequestError("num_speculative_tokens",
                                      f"must be in [0, {self.max_speculative_tokens}], got {k}")
        if math.isnan(m.temperature) or math.isnan(m.top_p):
            raise InvalidRequestError("temperature" if math.isnan(m.temperature) else "top_p",
                                      "must be a number")
        stop_ids = tuple(m.stop_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            stop_ids += (self.tokenizer.eos_token_id,)
        params = SamplingParams(
            temperature=m.temperature, top_k=m.top_k, top_p=m.top_p or 1.0,
            seed=m.seed if m.HasField("seed") else None,
            max_tokens=m.max_tokens or self.default_max_tokens, stop_token_ids=stop_ids)
        request = Request(m.request_id or uuid.uuid4().hex, prompt, params, k)
        self.engine.validate(request)
        return request

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await self.require_loaded(context)
        start, start_ns = time.perf_counter(), time.time_ns()
        stop = list(request.stop)
        try:
            req = self.to_request(request)
            if stop and self.tokenizer is None:
                raise InvalidRequestError("stop", "this server has no tokenizer to match "
                                          "stop strings; use stop_token_ids")
        except InvalidRequestError as exc:
            metrics.REQUESTS.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        metrics.PROMPT.inc(len(req.prompt_token_ids))
        remaining = context.time_remaining()
        if remaining is not None:  # the client's deadline bounds the internal calls too
            req.deadline = time.monotonic() + remaining
        span = tracing.RequestSpan("spec_decode.request", {
            "specdecode.request_id": req.request_id,
            "specdecode.prompt_tokens": len(req.prompt_token_ids),
            "specdecode.max_tokens": req.sampling_params.max_tokens,
            "specdecode.temperature": req.sampling_params.temperature}, start_ns)
        req.trace_context = span.context
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.loop.submit(req, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        text = TextStream(self.tokenizer, stop) if self.tokenizer is not None else None
        output: list[int] = []
        finished = False
        last = start
        item = None
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    metrics.REQUESTS.labels("error").inc()
                    span.end(_span_attributes(req, output, None, "error"), error=item)
                    await context.abort(_status_for(item), str(item))
                response, finished = self._response(req, item, output, text)
                now, n = time.perf_counter(), len(response.token_ids)
                if n:
                    (metrics.TTFT.observe(now - start) if len(output) == n
                     else metrics.ITL.observe((now - last) / n))
                    metrics.GENERATED.inc(n)
                last = now
                if finished:
                    metrics.E2E.observe(now - start)
                    reason = pb.FinishReason.Name(response.finish_reason) \
                        .removeprefix("FINISH_REASON_").lower()
                    metrics.REQUESTS.labels(reason).inc()
                    span.end(_span_attributes(req, output, item.stats, reason))
                yield response
        finally:
            if not finished:  # the client cancelled or went away: free the sequence now
                metrics.REQUESTS.labels("cancelled").inc()
                self.loop.abort(req.request_id)
            span.end(_span_attributes(req, output, getattr(item, "stats", None), "cancelled"))

    def _response(self, req: Request, out: StepOutput, output: list[int],
                  text: TextStream | None) -> tuple[pb.GenerateResponse, bool]:
        output += out.new_token_ids
        finish = out.finish_reason
        delta = ""
        if text is not None:
            shown = output[:-1] if finish == "stop" and output[-1] in req.sampling_params.stop_token_ids else output
            delta = text.update(shown, final=finish is not None)
            if text.stopped and finish is None:
                finish = "stop"
                self.loop.abort(req.request_id)
        response = pb.GenerateResponse(request_id=req.request_id, text=delta,
                                       token_ids=out.new_token_ids)
        if finish:
            response.finish_reason = FINISH[finish]
            response.usage.CopyFrom(usage_of(len(req.prompt_token_ids), len(output), out.stats))
        return response, finish is not None


def _span_attributes(req: Request, output: list[int], stats, finish_reason: str) -> dict:
    """The request span's closing attributes (usage, as the final response reports it)."""
    attrs = {"specdecode.completion_tokens": len(output),
             "specdecode.finish_reason": finish_reason}
    if stats is not None:
        attrs.update({"specdecode.draft_tokens": stats.draft_tokens,
                      "specdecode.accepted_tokens": stats.accepted_tokens,
                      "specdecode.emitted_tokens": stats.emitted_tokens,
                      "specdecode.steps": stats.steps})
        if stats.draft_tokens:
            attrs["specdecode.acceptance_rate"] = stats.acceptance_rate
    return attrs


def _status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, (grpc.RpcError, ServiceUnavailableError)):  # a service failed
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, DeadlinePassedError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc_status_of(exc)
