"""Clients that never read what they asked for (back-pressure drills): an HTTP streaming
completion sent on a raw socket that never calls recv, and a gRPC Generate stream that is
never iterated. Each asks its kernel and its HTTP/2 window to absorb as little as they
allow, so the server's writes block soon."""

from __future__ import annotations

import json
import socket

import grpc

from specdecode.v1 import spec_decode_service_pb2 as pb
from specdecode.v1 import spec_decode_service_pb2_grpc as pb_grpc

# The client's receive buffer (the kernel doubles it; it bounds the TCP window).
RECEIVE_BUFFER = 4096


def http_stalled(port: int, prompt: list[int], max_tokens: int, logprobs: int = 5,
                 receive_buffer: int | None = RECEIVE_BUFFER) -> socket.socket:
    """A streamed /v1/completions (with `logprobs`, so each event is large) whose socket is
    never read (its receive buffer `receive_buffer`, None: the kernel's default); the
    caller closes it."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "logprobs": logprobs}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", port))
    sock.sendall(head + body)
    return sock


def closed_by_server(sock: socket.socket, timeout_s: float = 30.0) -> bool:
    """Read what the socket holds until the server's close (EOF or reset): True; False if it
    is still open after `timeout_s` of silence."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    return True


def grpc_stalled(address: str, prompt: list[int], max_tokens: int
                 ) -> tuple[grpc.Channel, grpc.Call]:
    """A Generate stream never iterated, on a channel with a small flow-control window
    (no BDP probing to grow it); close the channel when done."""
    channel = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0),
                                                      ("grpc.http2.lookahead_bytes", 4096)])
    call = pb_grpc.SpecDecodeServiceStub(channel).Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens, ignore_eos=True))
    return channel, call
