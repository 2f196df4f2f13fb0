"""What every specdecode gRPC server shares: options, health, reflection, error mapping,
Prometheus endpoint, and a graceful shutdown on SIGTERM that really drains."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdecode.model_info import IncompatibleModelsError
from specdecode.sequence import InvalidRequestError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    metrics_port: int = 0  # 0 = no /metrics endpoint
    grace_seconds: float = 20.0  # drain time on SIGTERM
    max_message_mb: int = 64

    @property
    def channel_options(self) -> list[tuple[str, int]]:
        size = self.max_message_mb * 1024 * 1024
        return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


def grpc_status_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, IncompatibleModelsError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


class Deferred:
    """A servicer registered before its model is loaded (gRPC takes no services after
    start): its calls get UNAVAILABLE until `attach` hands it what it serves."""

    loaded = False

    def attach(self, **parts) -> None:
        vars(self).update(parts)
        self.loaded = True

    async def require_loaded(self, context: grpc.aio.ServicerContext) -> None:
        if not self.loaded:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "still loading; retry when health reports SERVING")


def map_errors(method: Callable) -> Callable:
    """Servicer method decorator: UNAVAILABLE while loading; bad input -> INVALID_ARGUMENT
    naming the field; anything else -> INTERNAL with the exception's text (logged)."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        await self.require_loaded(context)
        try:
            return await method(self, request, context)
        except (InvalidRequestError, IncompatibleModelsError) as exc:
            await context.abort(grpc_status_of(exc), str(exc))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.exception("%s failed", method.__qualname__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    return wrapper


class GrpcServer:
    """A grpc.aio server with health (NOT_SERVING until `set_serving`) and reflection."""

    def __init__(self, options: ServerOptions, service_names: list[str]):
        self.options = options
        self.server = grpc.aio.server(options=options.channel_options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port = self.server.add_insecure_port(f"{options.host}:{options.port}")
        self._stopping = asyncio.Event()

    async def _set_status(self, status) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def start(self) -> None:
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.options.metrics_port:
            prometheus_client.start_http_server(self.options.metrics_port, addr=self.options.host)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        log.info("listening on %s:%d", self.options.host, self.port)

    async def set_serving(self) -> None:
        await self._set_status(health_pb2.HealthCheckResponse.SERVING)

    async def wait_for_termination(self) -> None:
        """Block until SIGTERM/SIGINT, then drain: refuse new calls (UNAVAILABLE), let
        in-flight calls finish within the grace period, and return."""
        await self._stopping.wait()
        log.info("draining for up to %.1fs", self.options.grace_seconds)
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(self.options.grace_seconds)
        log.info("stopped")

    def request_stop(self) -> None:
        self._stopping.set()
