"""HTTP guards of the OpenAI API: bearer tokens, a request body's size bound before it is
parsed, and the cancellation of a non-streamed generation whose client went away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException

from orchestrator.frontend.openai_protocol import APIError
from specdecode.serving.auth import TokenSet

T = TypeVar("T")


def require_token(app: FastAPI, tokens: TokenSet, prefix: str | tuple[str, ...]) -> None:
    """Paths under `prefix` (or any of several) need `Authorization: Bearer <token>` for one
    of `tokens` (401 in OpenAI's shape otherwise); the rest (health, version, metrics) stay
    open, as for gRPC."""

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        if request.url.path.startswith(prefix) and \
                tokens.authenticate(request.headers.get("authorization")) is None:
            return APIError(401, "authorization: a valid bearer token is required",
                            code="invalid_api_key").response()
        return await call_next(request)


class BodyLimit:
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


async def unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.25) -> T:
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
