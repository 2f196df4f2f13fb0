"""`refusal`: a method handler that answers every call with one status, for the server
interceptors that turn a call away before it reaches its servicer (BearerAuth, Draining)."""

from __future__ import annotations

import grpc


def refusal(handler, code: grpc.StatusCode, message: str):
    """A handler of the same kind as `handler` (unary or streaming, either side) that
    aborts with `code` and `message`."""

    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(stream, **kw)
