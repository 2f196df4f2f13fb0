"""An ASGI app served by uvicorn inside the orchestrator's asyncio loop, beside the grpc.aio
server. The gRPC server owns SIGTERM/SIGINT; on shutdown it stops this one, which refuses
new connections and lets running responses finish within the grace period."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from orchestrator.config import HttpLimits
from orchestrator.frontend.client_window import ClientWindow, send_window
from orchestrator.frontend.stream_watch import WRITE_TIMEOUTS
from specdecode.serving.server import check_port_free
from specdecode.serving.tls import TlsFiles

log = logging.getLogger(__name__)


# Each connection's kernel send buffer (the kernel doubles it), and the high-water mark of
# asyncio's write buffer above it. Left to itself, Linux grows a socket's to megabytes
# (tcp_wmem): a client that never reads would absorb a whole long stream there before its
# writes paused, and the stream write timeout could not start. What is left is the
# client's own receive window.
SEND_BUFFER_BYTES = 16 << 10
WINDOW_CHECK_S = 1.0  # how often a response's client window is read (client_window)


class _HeaderTimeout(H11Protocol):
    """h11 with a deadline on each request's headers (uvicorn has none: a client sending a
    byte now and then held its connection for ever): a connection that has not completed
    its next request's headers `header_timeout_s` after it opened or after its last
    response is closed. And one on its writes: a connection whose client takes nothing for
    `write_timeout_s` (its writes stay paused: the kernel's buffers and asyncio's are full;
    or, sooner, its advertised window stays short of its widest: client_window) is
    aborted, which ends its response as a client that leaves does (its generation is
    cancelled, its sequences released: docs/design.md, *Back-pressure*)."""

    header_timeout_s = 10.0
    write_timeout_s = 30.0
    _write_timer: asyncio.TimerHandle | None = None
    _window: ClientWindow | None = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_write_timer()
        super().connection_lost(exc)

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_expired(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing() or self.flow.write_paused:
            self._abort_unread()

    def _abort_unread(self) -> None:
        log.info("closing an HTTP connection that took nothing for %g s", self.write_timeout_s)
        WRITE_TIMEOUTS.labels("http").inc()
        self.transport.abort()  # close() would wait for the buffer to drain: for ever

    def _watch_window(self, sock: socket.socket) -> None:
        """Every WINDOW_CHECK_S while the connection is open: during a response, abort it
        once its client has held unread bytes for write_timeout_s; between responses there
        is nothing to take."""
        if self.transport.is_closing():
            return
        now, window = self.loop.time(), send_window(sock)
        if window is None:
            return
        if self.cycle is None or self.cycle.response_complete:
            self._window = ClientWindow(now)
        else:
            self._window.observe(window, now)
            if self._window.unread_for(now) >= self.write_timeout_s:
                self._abort_unread()
                return
        self.loop.call_later(WINDOW_CHECK_S, self._watch_window, sock)

    def _arm(self) -> None:
        self.loop.call_later(self.header_timeout_s, self._expire, self.cycle)

    def _expire(self, cycle) -> None:
        waiting = cycle is None or cycle.response_complete  # no request started since
        if self.cycle is cycle and waiting and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # bounded: Linux would grow it to megabytes a client never reads
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self._watch_window(sock)
        transport.set_write_buffer_limits(high=SEND_BUFFER_BYTES)  # asyncio's: 64 KiB
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the process's gRPC server handles the signals and calls HttpServer.stop


class HttpServer:
    def __init__(self, app, host: str, port: int, grace_seconds: float = 20.0,
                 tls: TlsFiles = TlsFiles(), limits: HttpLimits = HttpLimits(),
                 write_timeout_s: float = 30.0):
        """tls: the gRPC server's certificate and key (HTTPS), and with a CA, client
        certificates required (mutual TLS), as for gRPC. limits: connections, header and
        idle timeouts, header bytes (HttpLimits). write_timeout_s: the stream write
        timeout (a connection whose writes stay paused that long is aborted)."""
        tls_kw = {}
        if tls.enabled:
            tls_kw = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            if tls.ca:
                tls_kw.update(ssl_ca_certs=tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        # Checked here, before anything starts: a taken port is one clear line (uvicorn's
        # own failure is its log and a SystemExit from a task).
        check_port_free(host, port, "--http-port")
        config = uvicorn.Config(app, host=host, port=port, log_config=None, lifespan="off",
                                access_log=False, timeout_graceful_shutdown=grace_seconds,
                                **_limits(limits, write_timeout_s), **tls_kw)
        self.server = _Server(config)
        self.address = f"{host}:{port}"
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Listen; OSError naming the address when the port cannot be bound."""
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():  # uvicorn exits (SystemExit) when it cannot bind
                with contextlib.suppress(BaseException):
                    self._task.result()
                raise OSError(f"cannot serve HTTP on {self.address} (port in use?)")
            await asyncio.sleep(0.02)
        log.info("HTTP (OpenAI API) listening on %s", self.address)

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(BaseException):
            await self._task


def _limits(limits: HttpLimits, write_timeout_s: float) -> dict:
    """uvicorn.Config's arguments for `limits` (h11: the header bounds apply to it).
    uvicorn answers 503 once its connections, the asking one included, reach
    limit_concurrency: one more, so that max_connections are served."""
    protocol = type("HeaderTimeout", (_HeaderTimeout,),
                    {"header_timeout_s": limits.header_timeout_s,
                     "write_timeout_s": write_timeout_s})
    return {"http": protocol, "limit_concurrency": limits.max_connections + 1,
            "timeout_keep_alive": limits.keep_alive_s,
            "h11_max_incomplete_event_size": limits.max_header_bytes}
