"""StrictDecoding: the server interceptor that answers a request whose bytes do not parse
with INVALID_ARGUMENT (grpcio itself would answer UNKNOWN or INTERNAL), on every server
(specdecode.serving.server.GrpcServer) and every method, reflection's stream of requests
included."""

from __future__ import annotations

import grpc
import prometheus_client

MALFORMED = prometheus_client.Counter(
    "specdecode_malformed_requests", "Calls refused with INVALID_ARGUMENT because the request "
    "message did not parse.", ["method"])


class StrictDecoding(grpc.aio.ServerInterceptor):
    """A request that does not parse gets INVALID_ARGUMENT (grpcio itself would answer
    UNKNOWN or INTERNAL) and is counted in specdecode_malformed_requests_total; a stream of
    requests (reflection) is parsed message by message, each as it arrives."""

    def __init__(self):
        self._handlers: dict[str, tuple[object, object]] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        cached = self._handlers.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        parse, method = handler.request_deserializer, details.method.rsplit("/", 1)[-1]

        async def decode(raw: bytes, context):
            try:
                return parse(raw)
            except Exception as exc:  # DecodeError, RecursionError on absurd nesting, ...
                MALFORMED.labels(method).inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request: not a valid {method} request message "
                                    f"({type(exc).__name__})")

        async def parsed(raw_requests, context):
            async for raw in raw_requests:
                yield await decode(raw, context)

        def unary(behavior):
            async def run(raw, context):
                return await behavior(await decode(raw, context), context)
            return run

        def stream(behavior, streaming_requests: bool = False):
            async def run(raw, context):
                request = (parsed(raw, context) if streaming_requests
                           else await decode(raw, context))
                responses = behavior(request, context)
                try:
                    async for response in responses:
                        yield response
                finally:
                    await responses.aclose()
            return run

        kw = dict(request_deserializer=None, response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            wrapped = grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
        elif handler.unary_stream is not None:
            wrapped = grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), **kw)
        elif handler.stream_stream is not None:
            wrapped = grpc.stream_stream_rpc_method_handler(
                stream(handler.stream_stream, streaming_requests=True), **kw)
        else:  # no service here takes a stream for one response
            return handler
        self._handlers[details.method] = (handler, wrapped)
        return wrapped
