"""A client's advertised window (orchestrator.frontend.client_window): read from a real
loopback connection's TCP_INFO, and followed over time."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from orchestrator.frontend.client_window import ClientWindow, send_window


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO's window is Linux's")
def test_the_window_shrinks_by_what_a_client_leaves_unread_and_widens_when_it_reads():
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with client, conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)  # as served
            widest, sent = send_window(conn), 0
            assert widest and widest > 0
            conn.setblocking(False)
            try:  # until the client's buffer and the server's are full
                while sent < 64 << 20:
                    sent += conn.send(b"x" * 4096)
                    widest = max(widest, send_window(conn))
            except BlockingIOError:
                pass
            conn.setblocking(True)
            time.sleep(0.2)  # the last segments' ACKs
            narrowed = send_window(conn)
            assert narrowed < widest / 2 and sent < 64 << 20
            taken = 0
            while taken < sent:  # the client reads everything
                taken += len(client.recv(1 << 20))
            conn.sendall(b"y")  # its ACK carries the window the reads freed
            client.recv(1)
            deadline = time.monotonic() + 5.0
            while send_window(conn) <= narrowed and time.monotonic() < deadline:
                time.sleep(0.01)
            assert send_window(conn) > narrowed


def test_a_window_short_of_its_widest_counts_the_seconds_nothing_was_taken():
    w = ClientWindow(taken_at=0.0)
    w.observe(65536, 1.0)
    assert w.unread_for(5.0) == 0.0  # at its widest: nothing unread
    w.observe(60000, 2.0)
    w.observe(50000, 3.0)
    assert w.unread_for(10.0) == pytest.approx(9.0)  # taken last at 1.0 (its widest)
    w.observe(55000, 11.0)  # it read something: widened
    assert w.unread_for(12.0) == pytest.approx(1.0)
    w.observe(65536, 13.0)
    assert w.unread_for(40.0) == 0.0
