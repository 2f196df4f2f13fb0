"""Bearer-token authentication (docs/security.md).

Clients send `authorization: Bearer <token>` in the call's metadata. A server started with
a token file accepts any token listed in it (one per line; blank lines and `#` comments
ignored), so several clients can hold their own token and a token can be rotated by adding
the new one before removing the old. The file is read again when it changes. Tokens are
compared in constant time.

`TokenSet.authenticate` is the small interface other front ends (an HTTP API) call; the
gRPC servers use `BearerAuth`, a server interceptor. Health checks are always allowed (the
kubelet's gRPC probes carry no token).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from pathlib import Path

import grpc
from grpc_health.v1 import health

from specdecode.serving.refusal import refusal

log = logging.getLogger(__name__)

OPEN_SERVICES = (f"/{health.SERVICE_NAME}/",)


def read_tokens(path: str) -> list[str]:
    """Tokens listed in a file, one per line (blank lines and `#` comments skipped)."""
    lines = Path(path).read_text().splitlines()
    return [t for t in (line.strip() for line in lines) if t and not t.startswith("#")]


class TokenSet:
    """The tokens a server accepts, re-read when the file changes."""

    def __init__(self, path: str):
        self.path = path
        self._mtime = os.stat(path).st_mtime_ns
        self._digests = self._load()
        if not self._digests:
            raise ValueError(f"--auth-token-file: {path} lists no token")

    def _load(self) -> list[bytes]:
        # Compare digests: equal lengths, and nothing about a token's length leaks.
        return [hashlib.sha256(t.encode()).digest() for t in read_tokens(self.path)]

    def _refresh(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime != self._mtime:
                digests = self._load()
                if digests:
                    self._digests, self._mtime = digests, mtime
                    log.info("auth tokens reloaded from %s (%d tokens)", self.path, len(digests))
        except OSError as exc:  # being replaced: keep the tokens we have
            log.warning("cannot re-read %s: %s", self.path, exc)

    def authenticate(self, authorization: str | None) -> int | None:
        """The index of the matching token (a client id for rate limits and logs) for an
        `authorization` header value, or None. Every token is compared, in constant time."""
        self._refresh()
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        digest = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for i, known in enumerate(self._digests):
            if hmac.compare_digest(digest, known):
                found = i
        return found


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries `token` (none when token is empty)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class BearerAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without a listed bearer token (UNAUTHENTICATED), except health checks."""

    def __init__(self, tokens: TokenSet):
        self.tokens = tokens

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        header = next((v for k, v in details.invocation_metadata or ()
                       if k == "authorization"), None)
        if self.tokens.authenticate(header) is None:
            reason = "missing" if header is None else "invalid"
            return refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                           f"authorization: {reason} bearer token")
        return handler


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _details(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self.metadata))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel`, sending `authorization: Bearer <token>` on every call (unchanged when
    token is empty)."""
    if not token:
        return channel
    return grpc.intercept_channel(channel, _AddMetadata(bearer_metadata(token)))
