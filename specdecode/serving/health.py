"""A server's grpc.health.v1 status, and waiting for SERVING (a server opens its port before
its model is loaded and answers NOT_SERVING until then, so a reachable port is not enough)."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class ServiceUnreachableError(RuntimeError):
    """A service that did not answer, or did not report SERVING, in time."""


UNREACHABLE = -1


def health_status(channel: grpc.Channel, timeout_s: float) -> int | None:
    """The server's grpc.health.v1 status; UNREACHABLE when its connection fails, None
    when it does not answer in time."""
    try:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s).status
    except grpc.RpcError as exc:
        return None if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else UNREACHABLE


def wait_serving(channel: grpc.Channel, timeout_s: float,
                 check: Callable[[], None] = lambda: None) -> bool:
    """Poll the channel's health service until SERVING (True) or `timeout_s` passes (False).
    `check` runs before each poll and may raise to give up early (e.g. the server's process
    has exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        left = deadline - time.monotonic()
        if health_status(channel, max(0.5, min(5, left))) == health_pb2.HealthCheckResponse.SERVING:
            return True
        if left <= 0:
            return False
        time.sleep(0.2)
