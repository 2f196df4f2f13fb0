"""Waiting for a server to report SERVING on grpc.health.v1 (a server opens its port before
its model is loaded and answers NOT_SERVING until then, so a reachable port is not enough)."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class ServiceUnreachableError(RuntimeError):
    """A service that did not answer, or did not report SERVING, in time."""


def wait_serving(channel: grpc.Channel, timeout_s: float,
                 check: Callable[[], None] = lambda: None) -> bool:
    """Poll the channel's health service until SERVING (True) or `timeout_s` passes (False).
    `check` runs before each poll and may raise to give up early (e.g. the server's process
    has exited)."""
    deadline = time.monotonic() + timeout_s
    stub = health_pb2_grpc.HealthStub(channel)
    while True:
        check()
        left = deadline - time.monotonic()
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=max(0.5, min(5, left)))
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return True
        except grpc.RpcError:
            pass
        if left <= 0:
            return False
        time.sleep(0.2)
