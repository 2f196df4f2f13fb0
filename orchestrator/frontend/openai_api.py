"""The OpenAI-compatible HTTP API (FastAPI), over the same Frontend as the gRPC API.

    POST /v1/completions        prompt text or token ids
    POST /v1/chat/completions   messages, through the tokenizer's chat template
    GET  /v1/models             the served model
    GET  /health                200 when serving, 503 while loading

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
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from specdecode.api import finish_reason
from orchestrator.frontend.admission import Overloaded, Slot
from orchestrator.engine.core import TokenLogprobs
from orchestrator.engine.errors import ServiceUnavailableError
from orchestrator.frontend.generation import Delta, Frontend, Generation, ServedModel
from specdecode.api.usage import Usage, add_usage, openai_usage
from specdecode.auth import TokenSet
from specdecode.sequence import InvalidRequestError

T = TypeVar("T")
log = logging.getLogger(__name__)


# -- errors ------------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.field)
    if isinstance(exc, Overloaded):  # gRPC's RESOURCE_EXHAUSTED, in HTTP's words
        return APIError(429, str(exc), "rate_limit_error", code="server_busy", headers={
            "Retry-After": str(math.ceil(exc.retry_after_s)),
            "retry-after-ms": str(int(exc.retry_after_s * 1000))})
    if isinstance(exc, (grpc.RpcError, ServiceUnavailableError)):  # a service failed
        return APIError(503, f"a backend service failed: {exc}", "service_unavailable")
    return APIError(500, f"{type(exc).__name__}: {exc}", "internal_server_error")


# -- request bodies ----------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields completions and chat share: OpenAI's, then vLLM's extensions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None  # None = 1.0, OpenAI's default
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None  # 0 or -1 = off
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    # ours
    num_speculative_tokens: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


# -- the app -----------------------------------------------------------------------------------

def create_app(frontend: Frontend, served: Callable[[], ServedModel | None],
               tokens: TokenSet | None = None, max_body_bytes: int = 2 << 20) -> FastAPI:
    """The HTTP app over `frontend`; `served()` describes the model (None while loading).
    With `tokens` (the gRPC API's --auth-token-file), every /v1/ call needs one of them as
    `Authorization: Bearer <token>` (401 otherwise); /health stays open, as for gRPC.
    A request body over `max_body_bytes` gets 413 before it is parsed."""
    app = FastAPI(title="specdecode OpenAI-compatible API", docs_url=None, redoc_url=None)
    api = _OpenAIApi(frontend, served)
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)

    if tokens is not None:
        @app.middleware("http")
        async def require_token(request: Request, call_next):
            if request.url.path.startswith("/v1/") and \
                    tokens.authenticate(request.headers.get("authorization")) is None:
                error = APIError(401, "authorization: a valid bearer token is required",
                                 code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
            return await call_next(request)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(Overloaded)
    async def on_overloaded(request: Request, exc: Overloaded):
        return _api_error(exc).response()

    @app.exception_handler(HTTPException)  # unknown routes, wrong methods, 413: same shape
    async def on_http_error(request: Request, exc: HTTPException):
        return APIError(exc.status_code, str(exc.detail), code=str(exc.status_code),
                        headers=exc.headers).response()

    @app.exception_handler(InvalidRequestError)
    async def on_invalid_request(request: Request, exc: InvalidRequestError):
        return JSONResponse(_api_error(exc).body(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.get("/health")
    async def health():
        if not frontend.loaded:
            raise APIError(503, "still loading", "service_unavailable")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        served = api.served()
        return {"object": "list", "data": [{
            "id": served.model_name, "object": "model", "created": api.created,
            "owned_by": "specdecode", "max_model_len": served.max_model_len,
            "draft_model": served.draft_model_name,
            "num_speculative_tokens": served.num_speculative_tokens,
            "scoring_method": served.scoring_method}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.admitted(api.completions, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.admitted(api.chat, body, request)

    return app


class _OpenAIApi:
    def __init__(self, frontend: Frontend, served: Callable[[], ServedModel | None]):
        self.frontend, self._served = frontend, served
        self.created = int(time.time())

    async def admitted(self, handler, body: _Sampling, request: Request):
        """Run a generation handler in an admission slot (429 when the server is full),
        held until its response ends: a streamed one releases it when its stream ends.
        A client that goes away before a non-streamed response is ready cancels it."""
        self.served()  # 503 while loading, before taking a slot
        slot = self.frontend.admit()
        try:
            response = await _unless_disconnected(request, handler(body, slot))
        except BaseException:
            slot.release()
            raise
        if not isinstance(response, StreamingResponse):
            slot.release()
        return response

    def _check_fields(self, body: _Sampling, *, text: str | None = None,
                      text_field: str = "prompt", num_token_ids: int = 0) -> None:
        """The request limits that need no tokenizer (RequestLimits.check_fields)."""
        self.frontend.check_fields(
            request_id="", text=text, text_field=text_field, num_token_ids=num_token_ids,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, stop=_stop_list(body),
            stop_token_ids=body.stop_token_ids or [],
            num_speculative_tokens=body.num_speculative_tokens)

    def served(self) -> ServedModel:
        info = self._served()
        if not self.frontend.loaded or info is None:
            raise APIError(503, "still loading; retry when /health answers 200",
                           "service_unavailable")
        return info

    def _check_model(self, model: str | None) -> ServedModel:
        served = self.served()
        if model and model != served.model_name:
            raise APIError(404, f"model: {model!r} is not served here; this server serves "
                                f"{served.model_name!r}", param="model", code="model_not_found")
        return served

    def _build(self, body: _Sampling, prompt: list[int], max_tokens: int | None,
               logprobs: int | None) -> Generation:
        bias = {}
        for key, value in (body.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidRequestError("logit_bias", f"keys must be token ids, got {key!r}") \
                    from None
        stop = _stop_list(body)
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {max_tokens}")
        return self.frontend.build(
            prompt, max_tokens=max_tokens or 0,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=max(0, body.top_k or 0), top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, logit_bias=bias, seed=body.seed,
            stop=stop, stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
            logprobs=logprobs, n=body.n, num_speculative_tokens=body.num_speculative_tokens)

    # -- completions ---------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, slot: Slot):
        served = self._check_model(body.model)
        for name, bad in (("echo", body.echo), ("suffix", body.suffix is not None),
                          ("best_of", body.best_of not in (None, body.n))):
            if bad:
                raise APIError(400, f"{name}: not supported by this server", param=name)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request (batches are not "
                                    "supported; use n for several samples)", param="prompt")
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else None
        self._check_fields(body, text=text, num_token_ids=0 if text is not None else len(prompt))
        ids = await self.frontend.tokenize_off_loop(text, "prompt") if text is not None \
            else prompt
        gen = self._build(body, list(ids), body.max_tokens, body.logprobs)
        rid, created = f"cmpl-{gen.request_id}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created,
                "model": served.model_name}
        logprobs = (_CompletionLogprobs(self.frontend, body.return_tokens_as_token_ids)
                    if body.logprobs is not None else None)

        def choice(d: Delta) -> dict:
            return {"index": d.index, "text": d.text,
                    "logprobs": logprobs.of(d) if logprobs else None,
                    "finish_reason": finish_reason.to_openai(d.finish_reason)}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            return _sse(self._chunks(gen, base, choice, include_usage), slot)

        choices: dict[int, dict] = {}
        total = Usage(prompt_tokens=len(gen.prompt_token_ids))
        try:
            async for d in self.frontend.run(gen):
                c = choices.setdefault(d.index, {"index": d.index, "text": "", "logprobs": None,
                                                 "finish_reason": None})
                c["text"] += d.text
                if logprobs:
                    c["logprobs"] = _merge_completion_logprobs(c["logprobs"], logprobs.of(d))
                if d.finish_reason:
                    c["finish_reason"] = finish_reason.to_openai(d.finish_reason)
                    total = add_usage(total, d.usage)
        except Exception as exc:
            raise _api_error(exc) from None
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

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tok = self.frontend.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "messages: this server's tokenizer has no chat template; use "
                                "/v1/completions", param="messages")
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):  # content parts: text only
                if any(p.get("type") != "text" for p in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content")
                content = "".join(p.get("text", "") for p in content)
            messages.append({"role": m.role, "content": content or ""})
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template refused the conversation (e.g. roles)
            raise APIError(400, f"messages: {exc}", param="messages") from None
        return tok(text, add_special_tokens=False).input_ids

    async def chat(self, body: ChatCompletionRequest, slot: Slot):
        served = self._check_model(body.model)
        if body.tools:
            raise APIError(400, "tools: not supported by this server", param="tools")
        if body.response_format and body.response_format.get("type") != "text":
            raise APIError(400, "response_format: only {\"type\": \"text\"} is supported",
                           param="response_format")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        self._check_fields(body, text_field="messages", text="".join(
            m.content if isinstance(m.content, str) else json.dumps(m.content or "")
            for m in body.messages))
        prompt = await asyncio.to_thread(self._chat_prompt, body)
        n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        gen = self._build(body, prompt, body.max_completion_tokens or body.max_tokens,
                          n_logprobs)
        base = {"id": f"chatcmpl-{gen.request_id}", "created": int(time.time()),
                "model": served.model_name}
        token_text = _TokenText(self.frontend, body.return_tokens_as_token_ids)

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
            return _sse(events(), slot)

        choices: dict[int, dict] = {}
        total = Usage(prompt_tokens=len(gen.prompt_token_ids))
        try:
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
        except Exception as exc:
            raise _api_error(exc) from None
        return {**base, "object": "chat.completion",
                "choices": [choices[i] for i in sorted(choices)], "usage": openai_usage(total)}


# -- conversions -------------------------------------------------------------------------------

class _TokenText:
    """A token's text: its decoded piece, or `token_id:<id>` without a tokenizer or when
    the request set return_tokens_as_token_ids (vLLM's form)."""

    def __init__(self, frontend: Frontend, as_ids: bool = False):
        self.tokenizer = None if as_ids else frontend.tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def chat_entry(self, e: TokenLogprobs) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            text = self(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}


class _CompletionLogprobs:
    """The legacy completions logprobs object of one delta; text offsets run on across a
    sample's deltas."""

    def __init__(self, frontend: Frontend, as_ids: bool):
        self.text = _TokenText(frontend, as_ids)
        self.offsets: dict[int, int] = {}

    def of(self, d: Delta) -> dict:
        entries = d.logprobs or []
        tokens = [self.text(e.token_id) for e in entries]
        offsets, at = [], self.offsets.get(d.index, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self.offsets[d.index] = at
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}


def _merge_completion_logprobs(acc: dict | None, new: dict) -> dict:
    if acc is None:
        return new
    return {key: acc[key] + new[key] for key in acc}


def _stop_list(body: _Sampling) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


class _BodyLimit:
    """ASGI middleware: 413 for a request body over max_bytes, by its Content-Length
    before anything is read, or while a chunked one is read."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, size: str) -> HTTPException:
        return HTTPException(413, f"request body: {size} bytes; at most {self.max_bytes} "
                                  f"(from the request limits: --max-prompt-tokens)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            error = self._too_large(length.decode())
            response = APIError(413, error.detail, code="413").response()
            return await response(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise self._too_large(f"more than {seen}")
            return message
        await self.app(scope, limited, send)


async def _unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.25) -> T:
    """`work`, cancelled (499) if the client disconnects first. Uvicorn does not cancel a
    handler whose client left: a non-streamed generation ran to max_tokens for no one and
    held its admission slot. (A streamed response is stopped when its stream ends, `_sse`.)"""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=poll_s))[0]:
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "client closed the request", code="client_closed_request")
        return task.result()
    finally:
        task.cancel()  # our own cancellation (server shutdown) reaches the work too


def _sse(events: AsyncIterator[dict], slot: Slot) -> StreamingResponse:
    """Server-sent events: each chunk as `data: <json>`, then `data: [DONE]`; an error
    after the stream began is sent as one `data: {"error": ...}` event. `slot` (the
    request's admission) is released when the stream ends."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except Exception as exc:
            error = _api_error(exc)
            if error.status >= 500:
                log.error("stream failed: %s", exc)
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:  # also when the client goes away: its samples are aborted at once
            await events.aclose()
            slot.release()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
