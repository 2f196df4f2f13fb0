"""One public generation request, whatever API it came through (gRPC or OpenAI HTTP): its
n samples submitted to the engine loop, their outputs turned into per-sample deltas of
text, token ids and logprobs, with the serving metrics and the request's trace span.

The API layers only translate: their request into a `Generation`, each `Delta` into their
response messages, and the exceptions into their error codes (InvalidRequestError is the
client's fault and names the field; Overloaded is a full server; anything else is the
server's). Both go through the same guard (docs/security.md), in this order: `admit` (a
slot, held until the response ends), `check_fields` (bounds that need no tokenizer),
`tokenize_off_loop`, then `build` (prompt length, max_tokens within the model length).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from orchestrator.frontend import request_metrics as metrics, semconv
from orchestrator.frontend.admission import Admission, Overloaded, RequestLimits, Slot
from orchestrator.engine.core import Request, StepOutput, TokenLogprobs
from orchestrator.engine.loop import EngineLoop
from orchestrator.frontend.text import TextStream
from specdecode.api.usage import Usage, add_usage
from specdecode import tracing
from specdecode.sequence import MAX_LOGPROBS, InvalidRequestError, SamplingParams


@dataclass(frozen=True)
class ServedModel:
    """What the public APIs serve (GetModelInfo, GET /v1/models)."""

    model_name: str  # the target model's
    draft_model_name: str  # or "ngram"
    vocab_size: int
    max_model_len: int
    num_speculative_tokens: int  # k when a request does not set its own
    max_speculative_tokens: int
    scoring_method: str  # "batch_expansion" | "multi_query"
    has_tokenizer: bool
    max_logprobs: int = MAX_LOGPROBS


@dataclass
class Generation:
    """A validated public request: n samples of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # seed None, or the seed of sample 0 (sample i gets seed + i)
    n: int = 1
    stop: list[str] = field(default_factory=list)  # stop strings
    num_speculative_tokens: int | None = None
    deadline: float | None = None  # the client's (time.monotonic()), bounding internal calls

    def requests(self) -> list[Request]:
        """One engine request per sample (ids `<id>` for n = 1, else `<id>/<i>`)."""
        out = []
        for i in range(self.n):
            params = self.params
            if params.seed is not None and i:
                params = dataclasses.replace(params, seed=params.seed + i)
            rid = self.request_id if self.n == 1 else f"{self.request_id}/{i}"
            out.append(Request(rid, self.prompt_token_ids, params, self.num_speculative_tokens,
                               deadline=self.deadline))
        return out


@dataclass
class Delta:
    """New output of one sample."""

    index: int  # which sample, in [0, n)
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # one per token id when asked for
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" on its last delta
    usage: Usage | None = None  # on its last delta


# Put in a running generation's queue by Frontend.cancel_all: its samples end at once.
_CANCEL = (None, None)


class Frontend:
    """Builds Generations (limits, tokenizing, defaults, validation) and runs them on the
    engine loop, for every public API. Serves after `attach`; `loaded` says whether it has
    been. `limits` (after attach) bound each request's fields, `admission` how many requests
    are inside at once."""

    loop: EngineLoop
    tokenizer = None
    loaded = False
    model_name = ""  # the target model's (gen_ai.request.model)
    limits: RequestLimits | None = None

    def __init__(self, default_max_tokens: int = 256, max_speculative_tokens: int = 16,
                 max_n: int = 16, admission: Admission | None = None):
        self.default_max_tokens = default_max_tokens
        self.max_speculative_tokens = max_speculative_tokens
        self.max_n = max_n
        # The output queue of every running generation, with its event loop.
        self._queues: dict[asyncio.Queue, asyncio.AbstractEventLoop] = {}
        self.admission = admission or Admission(max_running=64, max_queued=256)

    def attach(self, loop: EngineLoop, tokenizer, model_name: str = "",
               limits: RequestLimits | None = None) -> None:
        self.loop, self.tokenizer, self.loaded = loop, tokenizer, True
        self.model_name, self.limits = model_name, limits

    def admit(self) -> Slot:
        """A slot for one request, to release when its response ends; Overloaded when the
        server is full (RESOURCE_EXHAUSTED / HTTP 429, with a retry hint)."""
        try:
            return self.admission.admit()
        except Overloaded:
            metrics.REQUESTS.labels("overloaded").inc()
            raise

    def check_fields(self, **fields) -> None:
        """RequestLimits.check_fields, before any tokenizing (no-op before attach)."""
        if self.limits is not None:
            self.limits.check_fields(**fields)

    async def tokenize_off_loop(self, text: str, field_name: str = "prompt.text") -> list[int]:
        return await asyncio.to_thread(self.tokenize, text, field_name)

    @property
    def engine(self):
        return self.loop.engine

    def tokenize(self, text: str, field_name: str = "prompt.text") -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(field_name, "this server has no tokenizer; send token ids")
        return self.tokenizer(text).input_ids if text else []

    def build(self, prompt: list[int], *, max_tokens: int = 0, temperature: float = 0.0,
              top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
              repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
              frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None,
              seed: int | None = None, stop: list[str] = (),
              stop_token_ids: list[int] = (), ignore_eos: bool = False,
              logprobs: int | None = None, n: int = 1,
              num_speculative_tokens: int | None = None, request_id: str = "") -> Generation:
        """A Generation, or InvalidRequestError naming the first bad field. max_tokens 0 =
        the server default; the model's end-of-sequence token stops unless ignore_eos."""
        if max_tokens < 0:
            raise InvalidRequestError("max_tokens", f"must be >= 0, got {max_tokens}")
        if self.limits is not None:
            self.limits.check_prompt_len(len(prompt))
            max_tokens = self.limits.max_tokens_for(len(prompt), max_tokens,
                                                    self.default_max_tokens)
        if not 1 <= n <= self.max_n:
            raise InvalidRequestError("n", f"must be in [1, {self.max_n}], got {n}")
        k = num_speculative_tokens
        if k is not None and not 0 <= k <= self.max_speculative_tokens:
            raise InvalidRequestError("num_speculative_tokens",
                                      f"must be in [0, {self.max_speculative_tokens}], got {k}")
        for name, value in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
                            ("repetition_penalty", repetition_penalty),
                            ("presence_penalty", presence_penalty),
                            ("frequency_penalty", frequency_penalty)):
            if math.isnan(value):
                raise InvalidRequestError(name, "must be a number")
        stop = list(stop)
        if stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "this server has no tokenizer to match stop "
                                      "strings; use stop_token_ids")
        stop_ids = tuple(stop_token_ids)
        eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        if eos is not None and not ignore_eos:
            stop_ids += (eos,)
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            max_tokens=max_tokens or self.default_max_tokens, stop_token_ids=stop_ids,
            min_p=min_p, repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            logit_bias=dict(logit_bias or {}), logprobs=logprobs)
        gen = Generation(request_id or uuid.uuid4().hex, list(prompt), params, n, stop, k)
        for request in gen.requests():
            self.engine.validate(request)
        return gen

    def cancel_all(self) -> None:
        """End every running generation now, each sample with finish reason "cancelled"
        and the tokens it has (a draining server whose grace is running out), without
        waiting for the step under way, which may be stuck on a slow service; the engine
        loop releases their sequences at its next step boundary. Any thread."""
        for queue, loop in list(self._queues.items()):
            loop.call_soon_threadsafe(queue.put_nowait, _CANCEL)
        self.loop.cancel_all()

    async def run(self, gen: Generation) -> AsyncIterator[Delta]:
        """The samples' deltas as the engine produces them (interleaved across samples).
        Raises the exception that ended a request (the others are then aborted); a caller
        that stops iterating early aborts what is still running."""
        start, start_ns = time.perf_counter(), time.time_ns()
        requests = gen.requests()
        metrics.PROMPT.inc(len(gen.prompt_token_ids) * gen.n)
        span = tracing.RequestSpan("spec_decode.request", {
            "specdecode.request_id": gen.request_id,
            "specdecode.prompt_tokens": len(gen.prompt_token_ids),
            "specdecode.max_tokens": gen.params.max_tokens,
            "specdecode.temperature": gen.params.temperature, "specdecode.n": gen.n,
            **semconv.request_attributes(self.model_name, gen.params)}, start_ns)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._queues[queue] = loop
        samples = [_Sample(i, r, TextStream(self.tokenizer, gen.stop) if self.tokenizer else None)
                   for i, r in enumerate(requests)]
        for s in samples:
            s.request.trace_context = span.context
            self.loop.submit(s.request, lambda item, i=s.index:
                             loop.call_soon_threadsafe(queue.put_nowait, (i, item)))
        running = {s.index for s in samples}
        first, total = True, Usage()  # total: summed over finished samples
        ttft: float | None = None

        def closing(reason: str) -> dict:
            return {**_span_attributes(total, reason), **semconv.response_attributes(
                len(gen.prompt_token_ids), total.completion_tokens, reason, ttft,
                time.perf_counter() - start)}
        try:
            while running:
                index, item = await queue.get()
                if index is None:  # _CANCEL
                    for i in sorted(running):
                        queue.put_nowait((i, StepOutput(samples[i].request.request_id, [],
                                                        "cancelled", samples[i].stats)))
                    continue
                if index not in running:  # output after the sample was cancelled
                    continue
                sample = samples[index]
                if isinstance(item, BaseException):
                    metrics.REQUESTS.labels("error").inc()
                    span.end(closing("error"), error=item)
                    raise item
                delta = sample.delta(item, self.loop)
                now, n = time.perf_counter(), len(delta.token_ids)
                if n:
                    if first:
                        ttft = now - start
                        metrics.TTFT.observe(ttft, span.exemplar)
                    else:
                        metrics.ITL.observe((now - sample.last) / n, span.exemplar)
                    metrics.GENERATED.inc(n)
                    first = False
                sample.last = now
                if delta.finish_reason:
                    running.discard(index)
                    metrics.REQUESTS.labels(delta.finish_reason).inc()
                    total = add_usage(total, delta.usage)
                    if not running:
                        metrics.E2E.observe(now - start, span.exemplar)
                        span.end(closing(delta.finish_reason))
                yield delta
        finally:
            self._queues.pop(queue, None)
            for index in running:  # the caller went away or a sample failed: free the rest
                metrics.REQUESTS.labels("cancelled").inc()
                self.loop.abort(samples[index].request.request_id)
            span.end(closing("cancelled"))


@dataclass
class _Sample:
    index: int
    request: Request
    text: TextStream | None
    output: list[int] = field(default_factory=list)
    last: float = 0.0  # when it last produced tokens
    stats: Usage = field(default_factory=Usage)  # as of its last output

    def delta(self, out: StepOutput, loop: EngineLoop) -> Delta:
        self.output += out.new_token_ids
        self.stats = out.stats
        finish = out.finish_reason
        text = ""
        if self.text is not None:
            stop_ids = self.request.sampling_params.stop_token_ids
            shown = self.output[:-1] if finish == "stop" and self.output[-1] in stop_ids \
                else self.output
            text = self.text.update(shown, final=finish is not None)
            if self.text.stopped and finish is None:  # a stop string: end it here
                finish = "stop"
                loop.abort(self.request.request_id)
        usage = None
        if finish:
            usage = dataclasses.replace(out.stats, completion_tokens=len(self.output))
        return Delta(self.index, text, list(out.new_token_ids), out.logprobs, finish, usage)


def _span_attributes(usage: Usage, finish_reason: str) -> dict:
    """The request span's closing attributes (usage summed over the finished samples)."""
    attrs = {"specdecode.completion_tokens": usage.completion_tokens,
             "specdecode.finish_reason": finish_reason,
             "specdecode.draft_tokens": usage.draft_tokens,
             "specdecode.accepted_tokens": usage.accepted_tokens,
             "specdecode.emitted_tokens": usage.emitted_tokens,
             "specdecode.steps": usage.steps}
    if usage.draft_tokens:
        attrs["specdecode.acceptance_rate"] = usage.acceptance_rate
    return attrs
