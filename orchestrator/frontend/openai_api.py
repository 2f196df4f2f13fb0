"""The OpenAI-compatible HTTP API (FastAPI), over the same Frontend as the gRPC API.

    POST /v1/completions        prompt text or token ids
    POST /v1/chat/completions   messages, through the tokenizer's chat template
    GET  /v1/models             the served model (--served-model-name, else the target's)
    GET  /v1/models/{id}        that model, or 404
    GET  /health, GET|POST /ping   200 when serving, 503 naming why not (loading, no scorer
                                   up, draining): the gRPC health's state (/ping: SageMaker's)

and vLLM's /tokenize, /detokenize, /version and /metrics (orchestrator.frontend.vllm_api).
Every response carries an `X-Request-Id` (the client's, or a fresh one), which is also the
generation's id; requests are counted by route, method and status
(orchestrator.frontend.http_observability).

Streaming is server-sent events ending with `data: [DONE]`; `stream_options.include_usage`
adds a last chunk with the usage. Usage carries the speculative counters as the extension
object `usage.speculative`. Beyond OpenAI's fields, requests may set vLLM's `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, and `num_speculative_tokens`.
Log-probabilities are the target model's own (before temperature, penalties, bias and
truncation), as OpenAI and vLLM report them. Errors come in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with status 400 for bad input (the message
starts with the field's name), 404 for an unknown model, 503 while loading or when the
proposer or scorer cannot be reached, 500 otherwise. Fields this server cannot honour
(`echo`, `suffix`, `best_of` other than n, tools, non-text response formats) are refused
with 400, never ignored.

The guard is the gRPC API's (orchestrator.frontend.generation.Frontend, docs/security.md): bearer
tokens (401), request bodies over the size the request limits need (413), field limits
(400 naming the field: prompt length, max_tokens within the model length, stop strings,
finite temperature/top_p, k at most the server's), and admission: when the running and
queued requests are at their limits, 429 with `Retry-After` (seconds) and `retry-after-ms`,
as gRPC answers RESOURCE_EXHAUSTED with its `retry-after-ms` trailer. A client that goes
away cancels its generation, streamed or not (as a gRPC call's cancellation does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from orchestrator.frontend.admission import Slot
from orchestrator.frontend.chat_template import render_chat
from orchestrator.frontend.generation import Delta, Frontend, ServedModel
from orchestrator.frontend.http_guards import BodyLimit, require_token, unless_disconnected
from orchestrator.frontend.http_observability import HttpMetrics, RequestId, request_id_of
from orchestrator.frontend.openai_output import (CompletionLogprobs, TokenText,
                                                 merge_completion_logprobs, sse)
from orchestrator.frontend.openai_protocol import (APIError, ChatCompletionRequest,
                                                   CompletionRequest, SamplingFields,
                                                   add_error_handlers, refuse_unsupported,
                                                   to_request)
from orchestrator.frontend.request import Generation
from orchestrator.frontend.semconv import CHAT, TEXT_COMPLETION, Operation
from orchestrator.frontend.vllm_api import add_vllm_routes
from specdecode.api import finish_reason
from specdecode.api.usage import Usage, add_usage, openai_usage
from specdecode.serving.auth import TokenSet

log = logging.getLogger(__name__)


# -- the app -----------------------------------------------------------------------------------

def create_app(frontend: Frontend, tokens: TokenSet | None = None,
               max_body_bytes: int = 2 << 20) -> FastAPI:
    """The HTTP app over `frontend` (503 until it is attached).
    With `tokens` (the gRPC API's --auth-token-file), every /v1/ call needs one of them as
    `Authorization: Bearer <token>` (401 otherwise); /health stays open, as for gRPC.
    A request body over `max_body_bytes` gets 413 before it is parsed. The schema is at
    /openapi.json (behind the tokens when there are some); /docs and /redoc are off."""
    app = FastAPI(title="specdecode OpenAI-compatible API", docs_url=None, redoc_url=None)
    api = _OpenAIApi(frontend)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    if tokens is not None:  # the API's schema too: it lists what a token opens
        require_token(app, tokens, ("/v1/", "/tokenize", "/detokenize", "/openapi.json"))
    add_error_handlers(app)

    @app.get("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health():
        why = frontend.not_serving()
        if why:
            raise APIError(503, why, "service_unavailable")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [api.model_card(api.served())]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return api.model_card(api.check_model(model_id))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.admitted(api.completions, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.admitted(api.chat, body, request)

    add_vllm_routes(app, frontend, api.check_model)
    app.add_middleware(RequestId)
    app.add_middleware(HttpMetrics, routes=app.router.routes)  # outermost: sees every answer
    return app


class _OpenAIApi:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.created = int(time.time())

    async def admitted(self, handler, body: SamplingFields, request: Request):
        """Run a generation handler in an admission slot (429 when the server is full),
        held until its response ends: a streamed one releases it when its stream ends.
        A client that goes away before a non-streamed response is ready cancels it."""
        self.served()  # 503 while loading, before taking a slot
        slot = self.frontend.admit()
        try:
            response = await unless_disconnected(
                request, handler(body, slot, request_id_of(request.scope)))
        except BaseException:
            slot.release()
            raise
        if not isinstance(response, StreamingResponse):
            slot.release()
        return response

    def model_card(self, served: ServedModel) -> dict:
        """The model as /v1/models lists it: OpenAI's fields, vLLM's (`root`: what is
        served under the name, `max_model_len`), and the speculation's."""
        return {"id": served.model_name, "object": "model", "created": self.created,
                "owned_by": "specdecode", "root": served.target_model_name,
                "max_model_len": served.max_model_len, "draft_model": served.draft_model_name,
                "num_speculative_tokens": served.num_speculative_tokens,
                "scoring_method": served.scoring_method}

    def served(self) -> ServedModel:
        info = self.frontend.info
        if not self.frontend.loaded or info is None:
            raise APIError(503, "still loading; retry when /health answers 200",
                           "service_unavailable")
        return info

    def check_model(self, model: str | None) -> ServedModel:
        served = self.served()
        if model and model != served.model_name:
            raise APIError(404, f"model: {model!r} is not served here; this server serves "
                                f"{served.model_name!r}", param="model", code="model_not_found")
        return served

    # -- completions ---------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, slot: Slot, request_id: str):
        served = self.check_model(body.model)
        refuse_unsupported(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request (batches are not "
                                    "supported; use n for several samples)", param="prompt")
            prompt = prompt[0]
        gen = await self.frontend.prepare(to_request(
            body, prompt, body.max_tokens, body.logprobs, request_id=request_id,
            operation=Operation(TEXT_COMPLETION, "http", body.stream, "cmpl-")))
        rid, created = gen.operation.response_id(gen.request_id), int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created,
                "model": served.model_name}
        logprobs = (CompletionLogprobs(self.frontend.tokenizer, body.return_tokens_as_token_ids)
                    if body.logprobs is not None else None)

        def choice(d: Delta) -> dict:
            return {"index": d.index, "text": d.text,
                    "logprobs": logprobs.of(d) if logprobs else None,
                    "finish_reason": finish_reason.to_openai(d.finish_reason)}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            return sse(self._chunks(gen, base, choice, include_usage), slot)

        choices: dict[int, dict] = {}
        total = Usage(prompt_tokens=len(gen.prompt_token_ids))
        async for d in self.frontend.run(gen):
            c = choices.setdefault(d.index, {"index": d.index, "text": "", "logprobs": None,
                                             "finish_reason": None})
            c["text"] += d.text
            if logprobs:
                c["logprobs"] = merge_completion_logprobs(c["logprobs"], logprobs.of(d))
            if d.finish_reason:
                c["finish_reason"] = finish_reason.to_openai(d.finish_reason)
                total = add_usage(total, d.usage)
        return {**base, "choices": [choices[i] for i in sorted(choices)],
                "usage": openai_usage(total)}

    # -- chat ----------------------------------------------------------------------------------

    async def _chunks(self, gen: Generation, head: dict, choice: Callable[[Delta], dict],
                      include_usage: bool) -> AsyncIterator[dict]:
        """A stream's chunks: `head` with one choice per delta, then (include_usage) one
        chunk with no choices and the usage summed over the samples."""
        total = Usage(prompt_tokens=len(gen.prompt_token_ids))
        async with contextlib.aclosing(self.frontend.run(gen)) as deltas:
            async for d in deltas:
                yield {**head, "choices": [choice(d)], "usage": None}
                if d.usage:
                    total = add_usage(total, d.usage)
        if include_usage:
            yield {**head, "choices": [], "usage": openai_usage(total)}

    async def chat(self, body: ChatCompletionRequest, slot: Slot, request_id: str):
        served = self.check_model(body.model)
        refuse_unsupported(body)
        text = await asyncio.to_thread(render_chat, self.frontend.tokenizer,
                                       self.frontend.limits, body.messages)
        n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        gen = await self.frontend.prepare(to_request(
            body, text, body.max_completion_tokens or body.max_tokens, n_logprobs,
            prompt_field="messages", add_special_tokens=False, request_id=request_id,
            operation=Operation(CHAT, "http", body.stream, "chatcmpl-")))
        base = {"id": gen.operation.response_id(gen.request_id), "created": int(time.time()),
                "model": served.model_name}
        token_text = TokenText(self.frontend.tokenizer, body.return_tokens_as_token_ids)

        def chat_logprobs(d: Delta) -> dict | None:
            if d.logprobs is None:
                return None
            return {"content": [token_text.chat_entry(e) for e in d.logprobs]}

        def chat_choice(d: Delta) -> dict:
            delta = {"content": d.text} if d.text or not d.finish_reason else {}
            return {"index": d.index, "delta": delta, "logprobs": chat_logprobs(d),
                    "finish_reason": finish_reason.to_openai(d.finish_reason)}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events() -> AsyncIterator[dict]:
                chunk = {**base, "object": "chat.completion.chunk"}
                for i in range(gen.n):
                    yield {**chunk, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                       "content": ""},
                                                 "logprobs": None, "finish_reason": None}],
                           "usage": None}
                # closed with this generator, so a client that leaves ends the generation
                async with contextlib.aclosing(
                        self._chunks(gen, chunk, chat_choice, include_usage)) as chunks:
                    async for c in chunks:
                        yield c
            return sse(events(), slot)

        choices: dict[int, dict] = {}
        total = Usage(prompt_tokens=len(gen.prompt_token_ids))
        async for d in self.frontend.run(gen):
            c = choices.setdefault(d.index, {
                "index": d.index, "message": {"role": "assistant", "content": ""},
                "logprobs": {"content": []} if n_logprobs is not None else None,
                "finish_reason": None})
            c["message"]["content"] += d.text
            if d.logprobs is not None:
                c["logprobs"]["content"] += chat_logprobs(d)["content"]
            if d.finish_reason:
                c["finish_reason"] = finish_reason.to_openai(d.finish_reason)
                total = add_usage(total, d.usage)
        return {**base, "object": "chat.completion",
                "choices": [choices[i] for i in sorted(choices)], "usage": openai_usage(total)}


