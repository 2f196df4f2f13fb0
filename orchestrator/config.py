"""The orchestrator's configuration: one object, built once from the command line
(specdecode_stack.cli) and handed to `serve`, which composes the engine, the cluster and the
frontend from it. Plain dataclasses: importing this module starts nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.serving.limits import (MAX_REQUEST_ID_CHARS, MAX_STOP_STRING_CHARS,
                                       MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, TEXT_BYTES_PER_TOKEN)
from specdecode.serving.server import ServerOptions
from specdecode.serving.tls import TlsFiles

SPECULATION = ("adaptive", "fixed")
# Drafting ahead (orchestrator.engine.lookahead): where the policy prices it faster (never
# where the services share cores), always, never (lockstep).
ASYNC_DRAFTING = ("auto", "on", "off")


@dataclass(frozen=True)
class ResilienceOptions:
    """Deadlines, retries and replica checks."""

    proposer_timeout_s: float = 0.0  # per step call; 0 = sized from the step's work
    scorer_timeout_s: float = 0.0  # per step call; 0 = sized from the step's work
    scorer_retry_s: float = 30.0  # how long a step retries its scorer calls (> a cold start)
    health_interval_s: float = 1.0  # replica health checks
    resolve_interval_s: float = 10.0  # DNS re-resolution of the service names
    # Keepalive pings on every channel to a replica: a link that stops forwarding without
    # closing is closed after at most interval + timeout (then the replica is down).
    keepalive_interval_s: float = 1.0
    keepalive_timeout_s: float = 2.5


@dataclass(frozen=True)
class ServiceSecurity:
    """How the orchestrator reaches the services: TLS (trusting tls.ca, presenting
    tls.cert as its client certificate) and/or a bearer token on every call."""

    tls: TlsFiles | None = None
    token: str | None = None


@dataclass(frozen=True)
class AdmissionConfig:
    """Request limits, concurrency and the per-step token budget (both public APIs)."""

    max_prompt_tokens: int = 0  # 0 = the model length less one
    max_running: int = 64  # sequences decoded at once
    max_queued: int = 256  # requests waiting for a running slot
    max_num_batched_tokens: int = 512  # token budget of one step (chunked prefill)
    default_max_tokens: int = 256  # a request's max_tokens when it sets none
    # Upper bound of the model length, for the request-size limit before the model is
    # known (the public API's message-size limit is set when the server starts).
    max_model_len_hint: int = 32768

    @property
    def max_request_bytes(self) -> int:
        """Largest GenerateRequest worth reading: a prompt of max_prompt_tokens ids (10
        bytes each at most as varints) or of text, plus stop strings and the rest."""
        tokens = self.max_prompt_tokens or self.max_model_len_hint
        return (max(tokens * 10, tokens * TEXT_BYTES_PER_TOKEN)
                + MAX_STOP_STRINGS * (MAX_STOP_STRING_CHARS * 4 + 8)
                + MAX_STOP_TOKEN_IDS * 11 + MAX_REQUEST_ID_CHARS * 4 + 1024)


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP client may hold of the server (docs/security.md): connections (beyond
    it, 503), seconds to send a request's headers, seconds idle between requests, and the
    bytes of a request's headers."""

    max_connections: int = 1024  # open connections, and requests running, at most
    header_timeout_s: float = 10.0  # a connection's next request headers, complete
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after
    max_header_bytes: int = 32 << 10  # a request line and headers (h11's event size)


@dataclass(frozen=True)
class OrchestratorConfig:
    server: ServerOptions = field(default_factory=ServerOptions)
    proposer: str = "127.0.0.1:50052"  # replicas: HOST:PORT[,...] or a name resolving to many
    scorer: str = "127.0.0.1:50053"
    tokenizer: str | None = "default"  # a directory or .gguf, "default" (SmolLM2's), "none"
    # The model's name in both APIs and the metrics' model_name (None = the target's own).
    served_model_name: str | None = None
    num_speculative_tokens: int = 8  # k: what every sequence may speculate at most
    speculation: str = "adaptive"  # adaptive (k per sequence and step) or fixed (always k)
    connect_timeout_s: float = 60.0  # to reach both services at start
    trace_every: int = 1  # keep every Nth step span (1 = all, 0 = request spans only)
    http_port: int = 0  # the OpenAI-compatible HTTP API on the same host (0 = off)
    http: HttpLimits = HttpLimits()
    # A stream whose client takes nothing this long while its output waits is cancelled and
    # its sequences released (HTTP: its connection, whose writes stay paused, is closed).
    stream_write_timeout_s: float = 30.0
    sequence_deltas: bool = True  # step calls send what each replica lacks
    overlap: bool = False  # two groups alternate between proposer and scorer
    grammar_compile_timeout_s: float = 5.0  # a structured output request's grammar, at most
    async_drafting: str = "auto"  # draft the next proposal while this one is scored
    resilience: ResilienceOptions = ResilienceOptions()
    security: ServiceSecurity = ServiceSecurity()
    admission: AdmissionConfig = AdmissionConfig()
