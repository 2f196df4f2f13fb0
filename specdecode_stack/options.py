"""The `specdecode` command's options, in the groups its commands share (server, model,
limits, telemetry, ...), and --help in those groups' sections.

Every option made with `opt` can also be set as SPECDECODE_<OPTION> (e.g. SPECDECODE_PORT).
Sections are click's own (HelpFormatter.section, as click writes its "Options" section):
`option_group(title, ...)` tags each option with its section's title and `Sectioned`
commands list them under it. No extra library: the groups existed as decorators already,
and the help stays click's plain text. Nothing here imports torch or transformers (the
client path stays light).
"""

from __future__ import annotations

import click

from orchestrator.config import ASYNC_DRAFTING, SPECULATION
from scorer_svc.methods import SCORING_CHOICES
from specdecode.executor.compile_mode import COMPILE_MODES
from specdecode.executor.device import DEVICE_CHOICES, DTYPE_CHOICES
from specdecode.serving.limits import MAX_K
from specdecode.serving.tls import CLIENT_AUTH_CHOICES
from specdecode.telemetry.tracing import parse_trace_steps
from specdecode_stack.local import StackConfig

DEFAULTS = StackConfig()  # the defaults `serve`, `up`, `demo` and `generate` share
LOG_LEVELS = ("debug", "info", "warning", "error")


def opt(*names, **kw):
    """An option that also reads SPECDECODE_<NAME> from the environment."""
    long = next(n for n in names if n.startswith("--")).split("/")[0]  # --x/--no-x: X
    return click.option(*names, envvar="SPECDECODE_" + long[2:].upper().replace("-", "_"),
                        show_default=True, show_envvar=True, **kw)


class WholeText(click.types.StringParamType):
    """A repeatable option's text whose environment variable is one value, not split on
    whitespace as click does by default (a stop string is often "\\n\\n" or has spaces)."""

    envvar_list_splitter = "\0"  # cannot occur in an environment variable


def option_group(title: str, *options):
    """One decorator for several options, listed in this order under `title` in --help."""
    def decorate(fn):
        for o in reversed(options):
            fn = o(fn)
            fn.__click_params__[-1].help_group = title
        return fn
    return decorate


class Sectioned(click.Command):
    """A command whose --help lists its options in their groups' sections, in the order
    the groups first appear (options of no group last, under "Other options")."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                title = getattr(param, "help_group", "Other options")
                sections.setdefault(title, []).append(record)
        other = sections.pop("Other options", [])
        for title, records in [*sections.items(), ("Other options", other)]:
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


def _size(ctx, param, value) -> int | None:
    try:
        from specdecode.models.model_loading import parse_size
        return None if value is None else parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _trace_steps(ctx, param, value) -> int:
    try:
        return parse_trace_steps(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def server_options(default_port: int):
    return option_group(
        "Server",
        opt("--host", default="127.0.0.1", help="Address to bind (0.0.0.0 in a container)."),
        opt("--port", default=default_port, type=int, help="gRPC port (0 = any free port)."),
        opt("--metrics-port", default=0, type=int,
            help="Prometheus /metrics HTTP port (0 = off)."),
        opt("--metrics-host", default=None,
            help="Address of the /metrics endpoint (default: --host), e.g. an internal "
                 "interface the scraper reaches."),
        opt("--grace-seconds", default=20.0, type=float,
            help="On SIGTERM, how long in-flight requests may take to finish."),
        opt("--max-message-mb", default=64, type=int, help="Largest gRPC message, MiB."),
        opt("--reflection/--no-reflection", default=True,
            help="Serve gRPC server reflection."),
    )


_security = (
    opt("--tls-cert", default=None, type=click.Path(dir_okay=False),
        help="PEM certificate (chain): serve TLS (needs --tls-key). Re-read when the "
             "file changes."),
    opt("--tls-key", default=None, type=click.Path(dir_okay=False),
        help="PEM private key of --tls-cert."),
    opt("--tls-ca", default=None, type=click.Path(dir_okay=False),
        help="PEM CA: require client certificates signed by it (mutual TLS)."),
    opt("--auth-token-file", default=None, type=click.Path(dir_okay=False),
        help="Accept only calls with `authorization: Bearer <token>` for a token "
             "listed in this file (one per line; re-read when it changes). Health "
             "checks stay open."),
)
server_security_options = option_group("Security", *_security)
# The proposer's and scorer's: who may call them.
service_security_options = option_group(
    "Security", *_security,
    opt("--tls-client-auth", default="require", type=click.Choice(CLIENT_AUTH_CHOICES),
        help="require: with --tls-cert, accept only clients with a certificate signed by "
             "--tls-ca (starting without --tls-ca fails); none: serve TLS to any client "
             "(logged as a warning)."))


ASYNC_DRAFTING_HELP = ("Draft the next proposal while the scorer verifies this one (used only "
                       "when the verified prefix is the one it was drafted from; same "
                       "output): auto where the speculation policy prices it faster (never "
                       "when proposer and scorer share CPU cores), on always, off lockstep.")
DETERMINISTIC_CHOICES = ("auto", "on", "off")
DETERMINISTIC_HELP = ("on: row-invariant numerics, so that a sequence's logits do not depend "
                      "on its batch, its number of query tokens or the replica (greedy output "
                      "is then the target's own in bf16 too; docs/design.md, Invariant "
                      "numerics); off: the fastest kernels for each shape; auto: on for "
                      "bfloat16 and float16, off for float32.")

# Each in two groups: a server's (serve proposer|scorer, serve orchestrator) and the stack's.
deterministic_option = opt("--deterministic", default=DEFAULTS.deterministic,
                           type=click.Choice(DETERMINISTIC_CHOICES), help=DETERMINISTIC_HELP)
compile_option = opt(
    "--compile", "compile_mode", default=DEFAULTS.compile_mode, type=click.Choice(COMPILE_MODES),
    help="Compiled decode and verify forwards (torch.compile; CUDA graphs on CUDA): on; off "
         "(eager); auto: on on an accelerator, off on CPU. On an accelerator they compile at "
         "start-up; on CPU in the background while the service serves eagerly. Not with "
         "--deterministic on (its own attention).")
compile_cache_option = opt(
    "--compile-cache", default=DEFAULTS.compile_cache,
    help="Directory where compiled graphs are kept, so that a restart reloads them "
         "(inductor's caches; default: $TORCHINDUCTOR_CACHE_DIR, else under /tmp).")
cost_cache_option = opt(
    "--cost-cache", default=DEFAULTS.cost_cache,
    help="Directory where the measured forward-cost table is kept, so that a restart on the "
         "same host takes it after timing two forwards instead of every cell (keyed by the "
         "model, its options, torch, the threads and the CPU; default: not kept).")
async_drafting_option = opt("--async-drafting", default=DEFAULTS.async_drafting,
                            type=click.Choice(ASYNC_DRAFTING), help=ASYNC_DRAFTING_HELP)


model_options = option_group(
    "Model and device",
    opt("--device", default=DEFAULTS.device, type=click.Choice(DEVICE_CHOICES)),
    opt("--dtype", default=DEFAULTS.dtype, type=click.Choice(DTYPE_CHOICES)),
    opt("--max-model-len", default=None, type=int,
        help="Cap on tokens per sequence (default: the model's own limit, or what the KV "
             "cache budget holds if less)."),
    opt("--kv-cache-memory", default=None, callback=_size,
        help="KV cache pool size, allocated once at start: bytes or e.g. 512MiB, 4GiB "
             "(default: 2GiB, or less when max-num-seqs x max-model-len needs less)."),
    opt("--max-num-seqs", default=256, type=click.IntRange(1),
        help="Most sequences the KV cache keeps (least recently used are evicted)."),
    compile_option,
    compile_cache_option,
    cost_cache_option,
    deterministic_option,
    opt("--calibration-width", default=DEFAULTS.num_speculative_tokens + 1,
        type=click.IntRange(1),
        help="Widest forward (new tokens per row) the forward-cost table times, every width "
             "up to it: the orchestrator's --num-speculative-tokens + 1."),
)


def telemetry_options(log_format: str = "json", log_level: str = "info"):
    return option_group(
        "Logs and traces",
        opt("--log-format", default=log_format, type=click.Choice(["json", "text"]),
            help="Log lines on stderr: JSON objects (with trace_id/span_id) or plain text."),
        opt("--log-level", default=log_level, type=click.Choice(LOG_LEVELS),
            help="The least severe log lines written."),
        opt("--trace-console", is_flag=True, default=False,
            help="Also print every span to stdout (tracing is otherwise configured by the "
                 "OTEL_* environment variables, and off without them)."),
    )


service_limit_options = option_group(
    "Call limits",
    opt("--max-batch-seqs", default=256, type=click.IntRange(1),
        help="Most sequences in one call (at least the orchestrator's "
             "--max-running-requests)."),
    opt("--max-speculative-tokens", default=MAX_K, type=click.IntRange(0),
        help="Most draft tokens per sequence (k) in one call."),
    opt("--max-batch-tokens", default=0, type=click.IntRange(0),
        help="Most token ids in one call (0 = --max-batch-seqs x the max model length)."),
    opt("--sequence-lease-seconds", default=300.0, type=click.FloatRange(0, min_open=True),
        help="A sequence's cached state (KV cache, delta token store) is reclaimed this "
             "long after the last call that named it, if no release came."),
)


DRAFT_VOCAB_HELP = ("Draft model only: compute logits for this many most frequent token ids "
                    "(BPE merge rank), -inf for the rest; a vocabulary no larger is left "
                    "whole; 0 = the whole vocabulary. Output stays lossless.")
DRAFT_CONFIDENCE_HELP = ("Draft model only: stop a sequence's draft after a token whose "
                         "probability under the draft (greedy: its softmax; sampled: the "
                         "distribution's largest) is below this; 0 = always draft k tokens. "
                         "Output stays lossless.")

draft_options = option_group(
    "Draft",
    opt("--model", default=DEFAULTS.draft_model, help="Draft model directory or .gguf, or 'ngram'."),
    opt("--draft-vocab-size", default=DEFAULTS.draft_vocab_size, type=click.IntRange(0),
        help=DRAFT_VOCAB_HELP),
    opt("--draft-confidence", default=DEFAULTS.draft_confidence, type=click.FloatRange(0, 1),
        help=DRAFT_CONFIDENCE_HELP),
)

target_options = option_group(
    "Target",
    opt("--model", default="default",
        help="Target model directory or .gguf ('default' = SmolLM2-135M-Instruct)."),
    opt("--scoring", default=DEFAULTS.scoring, type=click.Choice(SCORING_CHOICES),
        help="auto: multi-query or batch expansion per call, whichever the measured forward "
             "costs say is cheaper."),
)

REPLICAS_HELP = ("replicas: HOST:PORT[,HOST:PORT...]; a name resolving to several addresses (a "
                 "headless Service) is one replica per address.")

orchestrator_model_options = option_group(
    "Model and speculation",
    opt("--tokenizer", default="default",
        help="Tokenizer directory or .gguf ('default' = SmolLM2's, 'none' = token ids only)."),
    opt("--served-model-name", default=None,
        help="The model's name in both APIs (/v1/models, responses, the `model` a request "
             "names) and in the metrics' model_name label (default: the target model's)."),
    opt("--num-speculative-tokens", default=DEFAULTS.num_speculative_tokens,
        type=click.IntRange(0, MAX_K),
        help="Draft tokens per step (k): the most with --speculation adaptive."),
    opt("--speculation", default=DEFAULTS.speculation, type=click.Choice(SPECULATION),
        help="adaptive: k per sequence and step (0 included) from its acceptance and the "
             "services' measured forward costs; fixed: always --num-speculative-tokens."),
    opt("--default-max-tokens", default=256, type=click.IntRange(1),
        help="max_tokens for requests that leave it 0."),
)

orchestrator_service_options = option_group(
    "Proposer and scorer",
    opt("--proposer", default="127.0.0.1:50052", help="Proposer " + REPLICAS_HELP),
    opt("--scorer", default="127.0.0.1:50053", help="Scorer " + REPLICAS_HELP),
    opt("--connect-timeout", default=60.0, type=float,
        help="Seconds to wait for the proposer and scorer at start."),
    opt("--proposer-timeout", default=0.0, type=click.FloatRange(0),
        help="Seconds a step waits for its proposals; past it the step goes on without "
             "speculation (same output). 0 = sized from the step's work."),
    opt("--scorer-timeout", default=0.0, type=click.FloatRange(0),
        help="Seconds one scoring call may take before it is retried on another replica. "
             "0 = sized from the step's work."),
    opt("--scorer-retry-timeout", default=30.0, type=click.FloatRange(0),
        help="Seconds a step retries failed scoring calls (with back-off, on the replicas up) "
             "before its streams fail with UNAVAILABLE; above a scorer's cold start, so that "
             "a restart of the only scorer ends no stream."),
    opt("--health-interval", default=1.0, type=click.FloatRange(0.05),
        help="Seconds between health checks of every proposer and scorer replica (a replica "
             "that failed rejoins after one)."),
    opt("--keepalive-interval", default=1.0, type=click.FloatRange(0.5),
        help="Seconds between keepalive pings on every channel to a proposer or scorer "
             "replica (also between calls)."),
    opt("--keepalive-timeout", default=2.5, type=click.FloatRange(0.1),
        help="Seconds a keepalive ping may go unanswered; then the connection is closed and "
             "the replica is down (a link that stops forwarding without closing is found in "
             "interval + timeout seconds), until it answers its health check again."),
    opt("--resolve-interval", default=10.0, type=click.FloatRange(0.1),
        help="Seconds between DNS look-ups of --proposer and --scorer (replicas come and go)."),
    opt("--sequence-deltas/--no-sequence-deltas", default=True,
        help="After a sequence's first step, send each service replica only the tokens appended "
             "since it last received the sequence, with the prefix's length and hash (a replica "
             "that lacks the prefix gets the sequence in full); off = full token ids every step."),
    opt("--overlap/--no-overlap", default=False,
        help="Split the running sequences into two groups that alternate, so the proposer drafts "
             "one while the scorer verifies the other (same output; pays when they are on "
             "different hosts or cores; prompts are then not prefilled in chunks)."),
    async_drafting_option,
    opt("--service-tls-ca", default=None, type=click.Path(dir_okay=False),
        help="PEM CA that signs the proposer's and scorer's certificates: connect to them over "
             "TLS (checking the certificate against the --proposer/--scorer host name), "
             "presenting --service-tls-cert (default --tls-cert) as the client certificate."),
    opt("--service-tls-cert", default=None, type=click.Path(dir_okay=False),
        help="Client certificate for the proposer and scorer (default: --tls-cert)."),
    opt("--service-tls-key", default=None, type=click.Path(dir_okay=False),
        help="Private key of --service-tls-cert (default: --tls-key)."),
    opt("--service-token-file", default=None, type=click.Path(dir_okay=False),
        help="File whose first token is sent as a bearer token to the proposer and scorer "
             "(their --auth-token-file), for clusters without mutual TLS."),
)

http_api_options = option_group(
    "HTTP API",
    opt("--http-port", default=8000, type=click.IntRange(0, 65535),
        help="Port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
             "/v1/models, /tokenize, /metrics, /health) on --host; 0 = off."),
    opt("--http-max-connections", default=1024, type=click.IntRange(1),
        help="Open HTTP connections (and requests running) at most; beyond it, 503."),
    opt("--http-header-timeout", default=10.0, type=click.FloatRange(0, min_open=True),
        help="Seconds a connection has to send its next request's headers; then it is "
             "closed (slow clients hold no connection for long)."),
    opt("--http-keep-alive-timeout", default=5.0, type=click.FloatRange(0, min_open=True),
        help="Seconds an idle keep-alive connection stays open."),
)

admission_options = option_group(
    "Request limits",
    opt("--max-prompt-tokens", default=0, type=click.IntRange(0),
        help="Longest prompt, tokens (0 = the model length less one)."),
    opt("--max-running-requests", default=64, type=click.IntRange(1),
        help="Requests decoded at once; more wait in the queue."),
    opt("--max-queued-requests", default=256, type=click.IntRange(0),
        help="Requests waiting for a running slot; beyond that, RESOURCE_EXHAUSTED with "
             "a retry hint."),
    opt("--max-num-batched-tokens", default=512, type=click.IntRange(16),
        help="Token budget of one step: running sequences first, then prompts, split "
             "across steps (chunked prefill) so a long prompt never stalls other streams."),
    opt("--stream-write-timeout", default=30.0, type=click.FloatRange(0, min_open=True),
        help="Seconds a streaming client may take nothing while its output waits (its "
             "sequence is paused meanwhile, KV state kept); then it is cancelled and its "
             "sequences released (HTTP: the connection is closed). The bytes its socket "
             "buffers and flow-control window absorb come first."),
    opt("--grammar-compile-timeout", default=5.0, type=click.FloatRange(0, min_open=True),
        help="Seconds a structured output request's grammar (JSON schema, regex, choice, "
             "grammar) may take to compile; past it the request is refused (400 / "
             "INVALID_ARGUMENT naming the field), and so is the same grammar later."),
)

trace_steps_option = option_group(
    "Logs and traces",
    opt("--trace-steps", default="all", callback=_trace_steps,
        help="Which step spans to keep when tracing: all, none (request spans only) or N "
             "(every Nth step)."),
)

# -- the local stack (up, demo) ------------------------------------------------------------

def plain(*names, **kw):
    """An option of `up` or `demo` alone, not read from the environment (their children,
    which inherit it, would read the same SPECDECODE_* variable)."""
    return click.option(*names, show_default=True, **kw)

stack_model_options = option_group(
    "Models",
    plain("--target-model", default=DEFAULTS.target_model,
        help="Target model directory or .gguf (default: SmolLM2-135M-Instruct)."),
    plain("--draft-model", default=DEFAULTS.draft_model,
        help="Draft model directory or .gguf, or 'ngram'."),
    plain("--device", default=DEFAULTS.device, type=click.Choice(DEVICE_CHOICES)),
    plain("--dtype", default=DEFAULTS.dtype, type=click.Choice(DTYPE_CHOICES)),
    plain("--max-model-len", default=None, type=click.IntRange(2),
        help="Cap on tokens per sequence, for the proposer and the scorer (default: the "
             "models' own limit)."),
    opt("--draft-vocab-size", default=DEFAULTS.draft_vocab_size, type=click.IntRange(0),
        help=DRAFT_VOCAB_HELP),
    opt("--draft-confidence", default=DEFAULTS.draft_confidence, type=click.FloatRange(0, 1),
        help=DRAFT_CONFIDENCE_HELP),
    deterministic_option,
    compile_option,
    compile_cache_option,
    cost_cache_option,
)

stack_speculation_options = option_group(
    "Speculation",
    plain("--scoring", default=DEFAULTS.scoring, type=click.Choice(SCORING_CHOICES)),
    plain("--num-speculative-tokens", default=DEFAULTS.num_speculative_tokens,
        type=click.IntRange(0, MAX_K), help="The most draft tokens per step."),
    opt("--speculation", default=DEFAULTS.speculation, type=click.Choice(SPECULATION),
        help="adaptive: k per sequence and step from measured costs; fixed: always k."),
    async_drafting_option,
)

_stack_port = plain("--port", default=DEFAULTS.port, type=int,
                    help="The orchestrator's gRPC port (0 = any free port; the services' are "
                         "free ports).")
demo_serving_options = option_group("Serving", _stack_port)
stack_serving_options = option_group(
    "Serving",
    plain("--host", default=DEFAULTS.host,
          help="Address all three bind (0.0.0.0: every interface)."),
    _stack_port,
    opt("--http-port", default=8000, type=click.IntRange(0, 65535),
        help="Port of the orchestrator's OpenAI-compatible HTTP API; 0 = off."),
    plain("--metrics-port", default=0, type=click.IntRange(0, 65533),
          help="Prometheus /metrics of the orchestrator on this port, the proposer's on the "
               "next, the scorer's on the one after (0 = free ports). Each is printed at start."),
    plain("--served-model-name", default=None,
          help="The model's name in the orchestrator's APIs and metrics (default: the target's)."),
)

stack_security_options = option_group(
    "Security",
    opt("--tls-cert", default=None, type=click.Path(exists=True, dir_okay=False),
        help="PEM certificate for all three servers (valid for 127.0.0.1): serve TLS."),
    opt("--tls-key", default=None, type=click.Path(exists=True, dir_okay=False),
        help="PEM private key of --tls-cert."),
    opt("--tls-ca", default=None, type=click.Path(exists=True, dir_okay=False),
        help="PEM CA of --tls-cert: the proposer and scorer then accept only clients with a "
             "certificate it signed (the orchestrator presents --tls-cert)."),
    opt("--auth-token-file", default=None, type=click.Path(exists=True, dir_okay=False),
        help="Bearer tokens the public API accepts, one per line."),
)

stack_log_options = option_group(
    "Logs",
    plain("--log-format", default="text", type=click.Choice(["json", "text"]),
          help="The three servers' log lines on stderr: plain text or JSON objects."),
    plain("--log-level", default="warning", type=click.Choice(LOG_LEVELS),
          help="The least severe log lines the servers write (info: every start-up step)."),
)
