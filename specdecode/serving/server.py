"""What every specdecode gRPC server shares: options, health, reflection, error mapping,
Prometheus endpoint, tracing of its calls, a graceful shutdown on SIGTERM that really
drains, and `serve_deferred`, the body of each service's entry point."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from specdecode.telemetry import tracing
from specdecode.serving.auth import OPEN_SERVICES, BearerAuth, TokenSet
from specdecode.serving.refusal import refusal
from specdecode.errors import INTERNAL, message_of, status_of
from specdecode.telemetry.served_metrics import SERVED
from specdecode.serving.strict_decoding import StrictDecoding
from specdecode.serving.tls import TlsFiles, server_credentials

log = logging.getLogger(__name__)

RPC_SECONDS = prometheus_client.Histogram(
    "specdecode_rpc_server_duration_seconds",
    "Time to handle one call of a specdecode service (health and reflection excluded); a "
    "Generate call lasts its whole stream.", ["method", "code"],
    buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))

# Server span status is ERROR for these codes (OpenTelemetry RPC conventions); a client's
# bad input (INVALID_ARGUMENT, ...) is the client's error, recorded as the code only.
SERVER_ERROR_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL,
                                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})


# Let the orchestrator's keepalive pings through (every --keepalive-interval, 1 s, also
# between calls), instead of answering them with GOAWAY "too_many_pings"
# (orchestrator.cluster.remote.keepalive_options).
KEEPALIVE_SERVER_OPTIONS = [("grpc.keepalive_permit_without_calls", 1),
                            ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
                            ("grpc.http2.max_ping_strikes", 0)]


class PortInUseError(OSError):
    """A server's port is taken (servers never share a port: no SO_REUSEPORT)."""


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    metrics_port: int = 0  # 0 = no /metrics endpoint
    grace_seconds: float = 20.0  # drain time on SIGTERM
    max_message_mb: int = 64
    tls: TlsFiles = TlsFiles()  # cert+key: serve TLS; ca: require client certificates
    auth_token_file: str | None = None  # accept only calls with a bearer token listed here
    reflection: bool = True  # serve grpc.reflection
    metrics_host: str | None = None  # interface of /metrics (None = host)
    # Largest request this server accepts, bytes (None = max_message_mb): the public API
    # takes small requests, whatever the internal services exchange.
    max_receive_bytes: int | None = None

    @property
    def channel_options(self) -> list[tuple[str, int]]:
        size = self.max_message_mb * 1024 * 1024
        return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]

    @property
    def server_options(self) -> list[tuple[str, int]]:
        receive = self.max_receive_bytes or self.max_message_mb * 1024 * 1024
        return [("grpc.max_send_message_length", self.max_message_mb * 1024 * 1024),
                ("grpc.max_receive_message_length", receive),
                ("grpc.so_reuseport", 0)]  # a second server on a taken port must fail


def check_port_free(host: str, port: int, what: str) -> None:
    """PortInUseError naming `what` if host:port cannot be bound (port 0 always can).
    Checked before grpc binds, so the error is one clear line and not grpc's log."""
    if not port:
        return
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc and http.server
            try:
                s.bind(address)
            except OSError as exc:
                raise PortInUseError(f"{what} {host}:{port} is not available: "
                                     f"{exc.strerror}") from None


class Deferred:
    """A servicer registered before its model is loaded (gRPC takes no services after
    start): its calls get UNAVAILABLE until `attach` hands it what it serves."""

    loaded = False
    model_name = ""  # the served model's name, for the metrics' model_name label

    def attach(self, **parts) -> None:
        vars(self).update(parts)
        self.loaded = True

    async def require_loaded(self, context: grpc.aio.ServicerContext) -> None:
        if not self.loaded:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "still loading; retry when health reports SERVING")


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    """Answer `exc` with its status from the one error table (specdecode.errors); the
    server's own faults are logged with their traceback."""
    status = status_of(exc)
    trace.get_current_span().record_exception(exc)
    if status is INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    elif status.server_fault:  # a service this one called failed: no traceback to show
        log.warning("%s failed: %s", method, exc)
    await context.abort(status.grpc_code, message_of(exc))


def map_errors(method: Callable) -> Callable:
    """Servicer method decorator: UNAVAILABLE while loading; an exception is answered with
    its status from the error table (bad input: INVALID_ARGUMENT naming the field)."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        await self.require_loaded(context)
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await abort_with(context, exc, method.__qualname__)

    return wrapper


def map_stream_errors(method: Callable) -> Callable:
    """map_errors for a response-streaming method (an async generator)."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        await self.require_loaded(context)
        responses = method(self, request, context)
        try:
            async for response in responses:
                yield response
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await abort_with(context, exc, method.__qualname__)
        finally:
            await responses.aclose()

    return wrapper


class _CallObserver:
    """One call: its server span (None when not traced) and its duration metric."""

    __slots__ = ("method", "span", "context", "start")

    def __init__(self, method: str, span, context):
        self.method, self.span, self.context = method, span, context
        self.start = time.perf_counter()

    def attach(self):
        return None if self.context is None else otel_context.attach(self.context)

    @staticmethod
    def detach(token) -> None:
        if token is not None:
            otel_context.detach(token)

    def finish(self, context: grpc.aio.ServicerContext, exc: BaseException | None) -> None:
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # the client went away
            code = grpc.StatusCode.CANCELLED
        elif exc is not None and not isinstance(exc, grpc.aio.AbortError):
            code = grpc.StatusCode.UNKNOWN
        else:
            code = context.code() or grpc.StatusCode.OK
            if isinstance(code, int):  # context.code() may hand back the raw value
                code = next((c for c in grpc.StatusCode if c.value[0] == code),
                            grpc.StatusCode.UNKNOWN)
        RPC_SECONDS.labels(self.method, code.name).observe(time.perf_counter() - self.start)
        span = self.span
        if span is None:
            return
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if exc is not None and not isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError,
                                                    GeneratorExit)):
            span.record_exception(exc)
        if code in SERVER_ERROR_CODES:
            details = context.details() if exc is None or isinstance(exc, grpc.aio.AbortError) \
                else f"{type(exc).__name__}: {exc}"
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}"))
        span.end()


class ServerTracing(grpc.aio.ServerInterceptor):
    """Server spans and call durations for the specdecode services (health checks and
    reflection pass untouched).

    The W3C trace context is read from the call's metadata. A sampled incoming context gets
    a SERVER span as its child; an unsampled one gets no span and silences the call's
    children (its step, or its whole request, is not traced). A call with no context
    starts a new trace only if `start_traces` (the public API does; the proposer and scorer
    only continue their caller's traces, so their start-up and housekeeping calls make no
    stray root traces)."""

    def __init__(self, start_traces: bool = True):
        self.start_traces = start_traces
        self._handlers: dict[str, tuple[object, object]] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or not method.startswith("/specdecode."):
            return handler
        cached = self._handlers.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        if handler.unary_unary is not None:
            wrapped = grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method[1:]),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        elif handler.unary_stream is not None:
            wrapped = grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method[1:]),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        else:
            return handler
        self._handlers[method] = (handler, wrapped)
        return wrapped

    def _observe(self, name: str, context: grpc.aio.ServicerContext) -> _CallObserver:
        method = name.rsplit(".", 1)[-1]  # "ProposerService/GetProposals"
        if not tracing.enabled():
            return _CallObserver(method, None, None)
        parent = tracing.extract_context(context.invocation_metadata())
        sc = tracing.span_context_of(parent)
        if sc.is_valid and not sc.trace_flags.sampled:
            # The caller does not sample this call: no span, but its unsampled context
            # becomes current, so nothing under it is sampled either.
            return _CallObserver(method, None, parent)
        if not sc.is_valid and not self.start_traces:
            return _CallObserver(method, None, None)
        service, rpc_method = name.split("/", 1)
        span = tracing.tracer("specdecode.server").start_span(
            name, context=parent, kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc_method})
        return _CallObserver(method, span, trace.set_span_in_context(span, parent))

    def _unary(self, behavior, name: str):
        async def traced(request, context):
            call = self._observe(name, context)
            token = call.attach()
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                call.finish(context, exc)
                raise
            finally:
                call.detach(token)
            call.finish(context, None)
            return response
        return traced

    def _stream(self, behavior, name: str):
        async def traced(request, context):
            # The context is attached only while the handler runs (around each __anext__),
            # never across a yield: the stream may be finished or closed by another task.
            call = self._observe(name, context)
            responses = behavior(request, context)
            error: BaseException | None = None
            try:
                while True:
                    token = call.attach()
                    try:
                        response = await responses.__anext__()
                    except StopAsyncIteration:
                        break
                    finally:
                        call.detach(token)
                    yield response
            except BaseException as exc:
                error = exc
                raise
            finally:
                try:
                    await responses.aclose()
                finally:
                    call.finish(context, error)
        return traced


class Draining(grpc.aio.ServerInterceptor):
    """Once `stopping` is set (SIGTERM), every new call but a health check gets UNAVAILABLE.
    grpcio's own stop refuses new calls too, but it starts a moment after health turns
    NOT_SERVING; a call accepted in between would meet a draining engine (docs/design.md,
    *SIGTERM*)."""

    def __init__(self, stopping: asyncio.Event):
        self.stopping = stopping

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not self.stopping.is_set() or \
                details.method.startswith(OPEN_SERVICES):
            return handler
        return refusal(handler, grpc.StatusCode.UNAVAILABLE, "server: draining (shutting down)")


class GrpcServer:
    """A grpc.aio server with health (NOT_SERVING until `set_serving`), reflection, and
    server spans (see ServerTracing; `start_traces` is False for the internal services)."""

    def __init__(self, options: ServerOptions, service_names: list[str],
                 start_traces: bool = True):
        self.options = options
        check_port_free(options.host, options.port, "--port")
        check_port_free(options.metrics_host or options.host, options.metrics_port,
                        "--metrics-port")
        self._stopping = asyncio.Event()
        interceptors = [Draining(self._stopping), StrictDecoding(), ServerTracing(start_traces)]
        if options.auth_token_file:  # outermost: refuse before any work
            interceptors.insert(0, BearerAuth(TokenSet(options.auth_token_file)))
        self.server = grpc.aio.server(options=options.server_options + KEEPALIVE_SERVER_OPTIONS,
                                      interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        if options.reflection:
            reflection.enable_server_reflection(
                [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        address = f"{options.host}:{options.port}"
        try:
            if options.tls.enabled:
                self.port = self.server.add_secure_port(address, server_credentials(options.tls))
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # taken between the check and here
            raise PortInUseError(f"--port {address} is not available") from None
        self.metrics = SERVED

    async def _set_status(self, status) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def start(self) -> None:
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.options.metrics_port:
            host = self.options.metrics_host or self.options.host
            try:
                registry = prometheus_client.CollectorRegistry(auto_describe=False)
                registry.register(self.metrics)
                prometheus_client.start_http_server(self.options.metrics_port, addr=host,
                                                    registry=registry)
            except OSError as exc:
                await self.server.stop(None)
                raise PortInUseError(f"--metrics-port {host}:{self.options.metrics_port} is "
                                     f"not available: {exc.strerror}") from None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        metrics = (f", metrics on http://{self.options.metrics_host or self.options.host}:"
                   f"{self.options.metrics_port}/metrics" if self.options.metrics_port else "")
        log.info("listening on %s:%d (%s)%s", self.options.host, self.port,
                 "mutual TLS" if self.options.tls.ca and self.options.tls.enabled
                 else "TLS" if self.options.tls.enabled else "plaintext", metrics)

    async def set_serving(self, serving: bool = True) -> None:
        """SERVING or NOT_SERVING (e.g. while a server it depends on is down); once
        draining, it stays NOT_SERVING."""
        if not self._stopping.is_set():
            await self._set_status(health_pb2.HealthCheckResponse.SERVING if serving
                                   else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def wait_for_termination(self, on_drain=None,
                                   companions: Sequence[Companion] = ()) -> None:
        """Block until SIGTERM/SIGINT, then drain: refuse new calls (UNAVAILABLE), let
        in-flight calls finish within the grace period, and return. `on_drain(grace)`, a
        coroutine function, runs while draining (it may end calls before the grace does).
        Companion servers (the orchestrator's HTTP API) drain at the same time."""
        await self._stopping.wait()
        log.info("draining for up to %.1fs", self.options.grace_seconds)
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        drain = None if on_drain is None else asyncio.ensure_future(
            on_drain(self.options.grace_seconds))
        await asyncio.gather(self.server.stop(self.options.grace_seconds),
                             *(c.stop() for c in companions))
        if drain is not None:
            drain.cancel()
        log.info("stopped")


class Companion(Protocol):
    """Another server in the same process and event loop (the orchestrator's HTTP API)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def _service_name(module) -> str:
    (service,) = module.DESCRIPTOR.services_by_name.values()
    return service.full_name


async def serve_deferred(options: ServerOptions, service_module, add, servicer: Deferred,
                         load: Callable[[], dict], start_traces: bool = False,
                         after_serving: Callable[[GrpcServer], None] | None = None,
                         on_drain=None, companions: Sequence[Companion] = ()) -> None:
    """Serve `servicer` (added to the server by `add`, the generated add_*_to_server) with
    health NOT_SERVING while `load` runs (in a thread); attach what it returns, report
    SERVING, and drain on SIGTERM. Only the public API starts traces; the proposer and
    scorer continue their caller's. after_serving(server) runs once SERVING; on_drain(grace)
    runs while draining (GrpcServer.wait_for_termination). Companion servers start with
    the gRPC server (before the load: they answer "loading" until then) and drain with it."""
    server = GrpcServer(options, [_service_name(service_module)], start_traces=start_traces)
    add(servicer, server.server)
    await server.start()
    started: list[Companion] = []
    try:
        for companion in companions:
            await companion.start()
            started.append(companion)
        servicer.attach(**await asyncio.to_thread(load))
    except BaseException:
        await asyncio.gather(server.server.stop(None), *(c.stop() for c in started))
        raise
    server.metrics.model_name = servicer.model_name
    await server.set_serving()
    if after_serving is not None:
        after_serving(server)
    await server.wait_for_termination(on_drain, started)
