"""The public APIs over the engine loop: the gRPC SpecDecodeService, the OpenAI-compatible
HTTP API, admission and request limits, request building and per-request metrics."""
