"""The OpenAI API's messages: request bodies (OpenAI's fields, then vLLM's extensions), their
conversion into the one request object both APIs share (orchestrator.frontend.request), and
errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, their status from
the one error table (specdecode.errors)."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from orchestrator.frontend.openai_structured import structured_output_of
from orchestrator.frontend.request import GenerationRequest
from specdecode.errors import TABLE as ERROR_TABLE
from specdecode.errors import InvalidRequestError, Overloaded, message_of, status_of
from specdecode.sequence import SamplingParams

log = logging.getLogger(__name__)


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


def api_error(exc: BaseException) -> APIError:
    """Any exception in OpenAI's shape, its status from the one error table."""
    if isinstance(exc, APIError):
        return exc
    status = status_of(exc)
    headers = None
    if isinstance(exc, Overloaded):  # gRPC's retry-after-ms trailer, in HTTP's words
        headers = {"Retry-After": str(math.ceil(exc.retry_after_s)),
                   "retry-after-ms": str(int(exc.retry_after_s * 1000))}
    return APIError(status.http_status, message_of(exc), status.openai_type,
                    getattr(exc, "field", None), status.openai_code, headers)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
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
    # structured output (orchestrator.frontend.openai_structured)
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # one engine here: accepted, nothing to pick
    # ours
    num_speculative_tokens: int | None = None


class CompletionRequest(SamplingFields):
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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None



def to_request(body: SamplingFields, prompt: str | list[int], max_tokens: int | None,
                logprobs: int | None, **options) -> GenerationRequest:
    """The body as a GenerationRequest, OpenAI's defaults (temperature 1) and vLLM's
    spellings (top_k -1 = off) applied, its structured output field read."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise InvalidRequestError("logit_bias", f"keys must be token ids, got {key!r}") \
                from None
    grammar, grammar_field = structured_output_of(body)
    params = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=max(0, body.top_k or 0), top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0, logit_bias=bias, seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()), logprobs=logprobs,
        structured_output=grammar)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return GenerationRequest(prompt, params, max_tokens=max_tokens, n=body.n, stop=stop,
                             ignore_eos=body.ignore_eos,
                             num_speculative_tokens=body.num_speculative_tokens,
                             grammar_field=grammar_field, **options)


def refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Fields this server cannot honour are refused (400), never ignored."""
    if isinstance(body, CompletionRequest):
        unsupported = (("echo", body.echo), ("suffix", body.suffix is not None),
                       ("best_of", body.best_of not in (None, body.n)))
    else:
        unsupported = (("tools", bool(body.tools)),)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    for name, bad in unsupported:
        if bad:
            raise APIError(400, f"{name}: not supported by this server", param=name)


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: APIError, the error table's (specdecode.errors),
    Starlette's (unknown routes, wrong methods, 413), body validation (400 naming the field),
    anything else (500, which Starlette also logs)."""

    async def on_error(request: Request, exc: Exception):
        error = api_error(exc)
        if error.status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, exc)
        return error.response()

    async def on_http_error(request: Request, exc: HTTPException):
        return APIError(exc.status_code, str(exc.detail), code=str(exc.status_code),
                        headers=exc.headers).response()

    async def on_validation_error(request: Request, exc: RequestValidationError):
        return validation_error(exc.errors()).response()

    for kind in (APIError, *(kind for kind, _ in ERROR_TABLE), Exception):
        app.add_exception_handler(kind, on_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)


def validation_error(errors: list[dict]) -> APIError:
    """FastAPI's first complaint about a body as a 400 naming the field; a body that is not
    JSON at all names none (FastAPI's location is then a byte offset, not a field)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        at = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
        reason = first.get("ctx", {}).get("error", "JSON decode error")
        where = f" at character {at}" if at is not None else ""
        return APIError(400, f"request body: not valid JSON ({reason}{where})")
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    message = f"{param}: {first.get('msg')}" if param else f"request body: {first.get('msg')}"
    return APIError(400, message, param=param)
