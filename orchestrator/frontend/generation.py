"""One public generation request, whatever API it came through (gRPC or OpenAI HTTP): checked
once (orchestrator.frontend.request), its n samples submitted to the engine loop, their
outputs turned into per-sample deltas of text, token ids and logprobs, with the serving
metrics and the request's trace span.

The API layers only translate: their message into a `GenerationRequest`, each `Delta` into
their response messages, and exceptions into their error codes (specdecode.errors: one
table). Both go through the same guard (docs/security.md), in this order: `admit` (a slot,
held until the response ends), then `prepare` (every bound that needs no tokenizer, then the
prompt's tokens off the event loop, then what needs them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from orchestrator.engine.loop import EngineLoop
from orchestrator.engine.outbox import OUTPUTS_PER_SAMPLE, Outbox
from orchestrator.engine.request import Request, StepOutput, TokenLogprobs
from orchestrator.frontend import genai_metrics, request_metrics as metrics, semconv
from orchestrator.frontend.admission import Admission, Slot
from orchestrator.frontend.request import Generation, GenerationRequest, RequestLimits
from orchestrator.frontend.stream_watch import WRITE_TIMEOUTS, StreamWatch
from specdecode.telemetry import tracing
from specdecode.api.usage import Usage, add_usage
from specdecode.errors import InvalidRequestError, Overloaded, StreamWriteTimeout
from specdecode.grammar.compiler import GrammarCompiler
from specdecode.sequence import MAX_LOGPROBS


@dataclass(frozen=True)
class ServedModel:
    """What the public APIs serve (GetModelInfo, GET /v1/models)."""

    model_name: str  # the name the APIs serve (--served-model-name, else the target's)
    target_model_name: str  # the target model's own (its directory or file)
    draft_model_name: str  # or "ngram"
    vocab_size: int
    max_model_len: int
    num_speculative_tokens: int  # k: the most a request may ask for, and its default
    scoring_method: str  # "batch-expansion" | "multi-query" | "auto"
    has_tokenizer: bool
    max_logprobs: int = MAX_LOGPROBS


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
    """Checks requests and runs them on the engine loop, for every public API. Serves after
    `attach`; `loaded` says whether it has been. `admission` bounds how many requests are
    inside at once (both APIs together)."""

    loop: EngineLoop
    tokenizer = None
    loaded = False
    info: ServedModel | None = None
    limits: RequestLimits | None = None
    grammars: GrammarCompiler | str = "not loaded"
    # Why the server does not serve although loaded (no scorer up, draining), or None: what
    # the gRPC health says, for HTTP /health (orchestrator.serve sets both together).
    unavailable: str | None = None

    def __init__(self, admission: Admission, stream_write_timeout_s: float = 30.0):
        """stream_write_timeout_s: a watched stream (`run(watch=True)`) whose client took
        nothing for that long while its output waited is cancelled."""
        # The output queue of every running generation, with its event loop.
        self._queues: dict[asyncio.Queue, asyncio.AbstractEventLoop] = {}
        self.admission = admission
        self.stream_write_timeout_s = stream_write_timeout_s

    def attach(self, loop: EngineLoop, tokenizer, info: ServedModel, limits: RequestLimits,
               grammars: GrammarCompiler | str = "no grammar compiler configured") -> None:
        """grammars: what compiles structured output requests' grammars, or why this
        server cannot (no tokenizer, a scorer without one)."""
        self.loop, self.tokenizer, self.info, self.limits = loop, tokenizer, info, limits
        self.grammars = grammars
        self.loaded = True

    def not_serving(self) -> str | None:
        """Why health is NOT_SERVING (both APIs), or None when SERVING."""
        return "still loading" if not self.loaded else self.unavailable

    @property
    def model_name(self) -> str:  # the served name (gen_ai.request.model)
        return self.info.model_name if self.info else ""

    def admit(self) -> Slot:
        """A slot for one request, to release when its response ends; Overloaded when the
        server is full (RESOURCE_EXHAUSTED / HTTP 429, with a retry hint)."""
        try:
            return self.admission.admit()
        except Overloaded:
            metrics.REQUESTS.labels("overloaded").inc()
            raise

    async def prepare(self, req: GenerationRequest) -> Generation:
        """The request checked, tokenized off the event loop and resolved; InvalidRequestError
        naming the first bad field."""
        self.limits.check(req)
        grammar = req.params.structured_output
        if grammar is not None:
            field = req.grammar_field or grammar.field
            if isinstance(self.grammars, str):
                raise InvalidRequestError(field, f"not served here: {self.grammars}")
            # compiled (or refused) within the compiler's time limit, off the event loop
            await asyncio.to_thread(self.grammars.matcher, grammar, field)
        prompt = req.prompt
        if isinstance(prompt, str):
            prompt = await asyncio.to_thread(self.tokenize, prompt, req.add_special_tokens)
        eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        return self.limits.resolve(req, prompt, req.request_id or uuid.uuid4().hex, eos)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids if text else []

    def cancel_all(self) -> None:
        """End every running generation now, each sample with finish reason "cancelled"
        and the tokens it has (a draining server whose grace is running out), without
        waiting for the step under way, which may be stuck on a slow service; the engine
        loop releases their sequences at its next step boundary. Any thread."""
        for queue, loop in list(self._queues.items()):
            loop.call_soon_threadsafe(queue.put_nowait, _CANCEL)
        self.loop.cancel_all()

    async def run(self, gen: Generation, slot: Slot | None = None,
                  watch: bool = False) -> AsyncIterator[Delta]:
        """The samples' deltas as the engine produces them (interleaved across samples).
        Raises the exception that ended a request (the others are then aborted); a caller
        that stops iterating early aborts what is still running. Back-pressure: while
        OUTPUTS_PER_SAMPLE x n outputs wait untaken, the samples are paused
        (orchestrator.engine.outbox); with `watch`, a client stalled for the stream write
        timeout is cancelled at once (sequences released, `slot` too), and its stream ends
        with StreamWriteTimeout should it ever read again."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._queues[queue] = loop
        metrics.PROMPT.inc(len(gen.prompt_token_ids) * gen.n)
        progress = _Progress(gen, self.model_name)
        outbox = Outbox(OUTPUTS_PER_SAMPLE * gen.n, self.loop.wake)
        samples = [_Sample(i, r) for i, r in enumerate(gen.requests(self.tokenizer))]
        for s in samples:
            s.request.trace_context, s.request.outbox = progress.span.context, outbox
            self.loop.submit(s.request, functools.partial(_deliver, loop, queue, outbox, s.index))
        running = {s.index for s in samples}
        stall = self._watch(gen, outbox, samples, running, slot, queue) if watch else None
        try:
            while running:
                index, item = await queue.get()
                if index is None:
                    if item is not None:  # the write timeout: its samples are aborted
                        running.clear()
                        progress.failed(item)
                        raise item
                    for i in sorted(running):  # _CANCEL
                        queue.put_nowait((i, StepOutput(samples[i].request.request_id, [],
                                                        "cancelled", samples[i].stats)))
                    continue
                outbox.take()
                if index not in running:  # output after the sample was cancelled
                    continue
                if isinstance(item, BaseException):
                    progress.failed(item)
                    raise item
                delta = samples[index].delta(item)
                if delta.finish_reason:
                    running.discard(index)
                progress.observe(samples[index], delta, done=not running)
                yield delta
        finally:
            if stall is not None:
                stall.close()
            self._queues.pop(queue, None)
            for index in running:  # the caller went away or a sample failed: free the rest
                metrics.REQUESTS.labels("cancelled").inc()
                self.loop.abort(samples[index].request.request_id)
            progress.end("cancelled")

    def _watch(self, gen: Generation, outbox: Outbox, samples: list[_Sample],
               running: set[int], slot: Slot | None, queue: asyncio.Queue) -> StreamWatch:
        """The stream write timeout of one generation (run): when its client stalls, its
        samples are aborted (released on the services at the next step boundary) and its
        slot released, and the timeout error queued for the generator, should it resume."""

        def expire() -> None:
            WRITE_TIMEOUTS.labels(gen.operation.api).inc()
            for i in running:  # the samples still running (a live view of run's set)
                self.loop.abort(samples[i].request.request_id)
            if slot is not None:
                slot.release()
            queue.put_nowait((None, StreamWriteTimeout(
                f"the client took no output for {self.stream_write_timeout_s:g} s")))

        return StreamWatch(outbox, self.stream_write_timeout_s, expire).start()


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, outbox: Outbox,
             index: int, item: StepOutput | BaseException) -> None:
    """A sample's sink (the engine thread): counted in its outbox, queued on the loop."""
    outbox.put()
    loop.call_soon_threadsafe(queue.put_nowait, (index, item))


class _Progress:
    """One generation's request span and serving metrics (Prometheus, and the GenAI
    conventions' OTLP histograms), as its deltas arrive."""

    def __init__(self, gen: Generation, model_name: str):
        self.gen, self.start, self.ttft = gen, time.perf_counter(), None
        self.total = Usage()  # summed over finished samples
        self.finish_reasons: dict[int, str] = {}  # sample index -> its finish reason
        op = gen.operation
        self.attributes = semconv.metric_attributes(op, model_name)
        self.span = tracing.RequestSpan(op.span_name(model_name), {
            "specdecode.request_id": gen.request_id,
            "specdecode.prompt_tokens": len(gen.prompt_token_ids),
            "specdecode.max_tokens": gen.params.max_tokens,
            "specdecode.temperature": gen.params.temperature, "specdecode.n": gen.n,
            **semconv.request_attributes(op, model_name, gen.params, gen.n, gen.stop,
                                         gen.request_id)}, time.time_ns())

    def observe(self, sample: _Sample, delta: Delta, done: bool) -> None:
        now, n = time.perf_counter(), len(delta.token_ids)
        if n:
            if self.ttft is None:
                self.ttft = now - self.start
                metrics.TTFT.observe(self.ttft, self.span.exemplar)
            else:
                metrics.ITL.observe((now - sample.last) / n, self.span.exemplar)
            metrics.GENERATED.inc(n)
        sample.last = now
        if delta.finish_reason:
            metrics.REQUESTS.labels(delta.finish_reason).inc()
            self.total = add_usage(self.total, delta.usage)
            self.finish_reasons[delta.index] = delta.finish_reason
            if done:
                metrics.E2E.observe(now - self.start, self.span.exemplar)
                tokens = self.total.completion_tokens
                if self.ttft is not None and tokens > 1:
                    metrics.TPOT.observe((now - self.start - self.ttft) / (tokens - 1),
                                         self.span.exemplar)
                self.end(delta.finish_reason)

    def failed(self, error: BaseException) -> None:
        metrics.REQUESTS.labels("error").inc()
        self.end("error", error)

    def end(self, reason: str, error: BaseException | None = None) -> None:
        """Close the span and record the GenAI metrics (once: later calls do nothing)."""
        if self.span.ended:
            return
        seconds = time.perf_counter() - self.start
        error_type = self.gen.operation.error_type(error, reason)
        reasons = [self.finish_reasons.get(i, reason) for i in range(self.gen.n)]
        attrs = {**_span_attributes(self.total, reason), **semconv.response_attributes(
            len(self.gen.prompt_token_ids), self.total.completion_tokens, reasons)}
        if self.ttft is not None:
            attrs["specdecode.time_to_first_token_s"] = self.ttft
        if error_type is not None:
            attrs["error.type"] = error_type
        genai_metrics.record(self.attributes, seconds, self.ttft,
                             self.total.completion_tokens, error_type)
        self.span.end(attrs, error=error)


@dataclass
class _Sample:
    index: int
    request: Request
    last: float = 0.0  # when it last produced tokens
    stats: Usage = field(default_factory=Usage)  # as of its last output

    def delta(self, out: StepOutput) -> Delta:
        self.stats = out.stats
        usage = dataclasses.replace(out.stats) if out.finish_reason else None  # a snapshot
        return Delta(self.index, out.text, list(out.new_token_ids), out.logprobs,
                     out.finish_reason, usage)


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
