"""The errors that cross an API boundary, and the one table that maps each to its gRPC code,
HTTP status and OpenAI error type (text-generation-inference's single exception mapping is the
model). The gRPC servicers (specdecode.serving.server.map_errors, the orchestrator's Generate)
and the OpenAI HTTP API (orchestrator.frontend.openai_api) all answer from `status_of`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from specdecode.model_info import IncompatibleModelsError


class InvalidRequestError(ValueError):
    """Bad input from a client (or a peer service); `field` names the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.detail = message


@contextmanager
def fields_of(prefix: str) -> Iterator[None]:
    """An InvalidRequestError raised inside names its field under `prefix` (a nested
    message's path, e.g. "request")."""
    try:
        yield
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{prefix}.{exc.field}", exc.detail) from None


class Overloaded(Exception):
    """No slot for another request: RESOURCE_EXHAUSTED; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServiceUnavailableError(RuntimeError):
    """No replica of a service could serve a step within its retry budget."""


class DeadlinePassedError(RuntimeError):
    """Every request of the step is past its client's deadline (DEADLINE_EXCEEDED)."""


class StreamWriteTimeout(RuntimeError):
    """A stream's client took nothing for --stream-write-timeout seconds while its output
    waited: cancelled (DEADLINE_EXCEEDED, after what was written before)."""


@dataclass(frozen=True)
class ErrorStatus:
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str
    openai_code: str | None = None

    @property
    def server_fault(self) -> bool:
        """The server's (or a service's) failure, not the client's: logged, span in ERROR."""
        return self.http_status >= 500


# First match wins. A grpc.RpcError reaching a public API is a proposer or scorer call that
# failed (the services' own calls never raise one).
TABLE: tuple[tuple[type[BaseException], ErrorStatus], ...] = (
    (InvalidRequestError, ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, 400,
                                      "invalid_request_error")),
    (Overloaded, ErrorStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error",
                             "server_busy")),
    (IncompatibleModelsError, ErrorStatus(grpc.StatusCode.FAILED_PRECONDITION, 500,
                                          "internal_server_error", "incompatible_models")),
    (DeadlinePassedError, ErrorStatus(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout",
                                      "deadline_exceeded")),
    (StreamWriteTimeout, ErrorStatus(grpc.StatusCode.DEADLINE_EXCEEDED, 408, "timeout",
                                     "stream_write_timeout")),
    (ServiceUnavailableError, ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503,
                                          "service_unavailable")),
    (grpc.RpcError, ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable")),
)
INTERNAL = ErrorStatus(grpc.StatusCode.INTERNAL, 500, "internal_server_error")


def status_of(exc: BaseException) -> ErrorStatus:
    return next((status for kind, status in TABLE if isinstance(exc, kind)), INTERNAL)


def message_of(exc: BaseException) -> str:
    """What the client reads: the text of errors the table names, the type too otherwise;
    a failed service call says so."""
    if isinstance(exc, grpc.RpcError):
        return f"a backend service failed: {exc}"
    return str(exc) if status_of(exc) is not INTERNAL else f"{type(exc).__name__}: {exc}"
