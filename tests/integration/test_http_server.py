"""The HTTP server's bounds on clients (orchestrator.frontend.http_server, docs/security.md):
the limits reach uvicorn; a connection over --http-max-connections gets 503; a connection
that does not complete its request headers within --http-header-timeout is closed; headers
over the byte bound are refused. A real uvicorn on 127.0.0.1 in a thread of this process,
plain sockets as clients. Waits are bounds, not speeds."""

from __future__ import annotations

import asyncio
import re
import socket
import threading

import pytest
from fastapi import FastAPI

from orchestrator.config import HttpLimits
from orchestrator.frontend.http_server import HttpServer
from specdecode_stack.local import free_port

REQUEST = b"GET /ok HTTP/1.1\r\nHost: test\r\n\r\n"


@pytest.fixture
def serve():
    """serve(limits) -> the port of a started HttpServer (stopped after the test)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = []

    def start(limits: HttpLimits) -> int:
        app = FastAPI()
        app.get("/ok")(lambda: {"ok": True})
        port = free_port()
        server = HttpServer(app, "127.0.0.1", port, grace_seconds=1, limits=limits)
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
        servers.append(server)
        return port
    yield start
    for server in servers:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def status_of(sock: socket.socket, request: bytes = REQUEST) -> int:
    """Send `request`, read the response's head; its status code."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = re.search(rb"content-length: (\d+)", head.lower())
    while length and len(body) < int(length.group(1)):  # so the next request starts clean
        chunk = sock.recv(4096)
        assert chunk, "closed within the body"
        body += chunk
    return int(head.split(b" ", 2)[1])


def test_the_limits_reach_uvicorn():
    server = HttpServer(FastAPI(), "127.0.0.1", free_port(),
                        limits=HttpLimits(7, header_timeout_s=3.0, keep_alive_s=2.0,
                                          max_header_bytes=4096))
    config = server.server.config
    assert (config.limit_concurrency, config.timeout_keep_alive,
            config.h11_max_incomplete_event_size) == (7 + 1, 2.0, 4096)  # + the asking one
    assert config.http.header_timeout_s == 3.0


def test_a_connection_over_the_limit_gets_503(serve):
    port = serve(HttpLimits(max_connections=1))
    with connect(port) as first:
        assert status_of(first) == 200  # served, and kept open (keep-alive)
        with connect(port) as second:
            assert status_of(second) == 503
        assert status_of(first) == 200  # the connection inside the limit still is served


def test_headers_not_completed_in_time_close_the_connection(serve):
    port = serve(HttpLimits(header_timeout_s=0.5))
    with connect(port) as slow:
        slow.sendall(b"GET /ok HTTP/1.1\r\nHost: te")  # and never the rest
        assert slow.recv(4096) == b""  # closed by the server (within the 30 s socket timeout)
    with connect(port) as idle:  # after a response, the next request's headers too
        assert status_of(idle) == 200
        idle.sendall(b"GET /ok HTTP/1.1\r\n")
        assert idle.recv(4096) == b""
    with connect(port) as prompt:
        assert status_of(prompt) == 200


def test_headers_over_the_byte_bound_are_refused(serve):
    """A request head still incomplete past the bound is refused: what a connection buffers
    stays bounded (h11 checks an incomplete head; a complete one read at once passes)."""
    port = serve(HttpLimits(max_header_bytes=4096))
    with connect(port) as sock:
        big = b"GET /ok HTTP/1.1\r\nHost: test\r\nX-Pad: " + b"a" * 8192  # no end yet
        assert status_of(sock, big) == 400
