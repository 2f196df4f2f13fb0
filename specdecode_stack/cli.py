"""The `specdecode` command: serve one service, run the local stack, generate, demo.

Every option of `serve` and `generate` can also be set as SPECDECODE_<OPTION> (e.g.
SPECDECODE_PORT, SPECDECODE_ADDRESS). Defaults shared with the local stack come from
StackConfig.

The client path (`generate`, `--help`, `--version`) imports neither torch nor transformers:
each command imports what it runs (docs/design.md).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
import grpc

from specdecode.api.client import GenerateResult, SpecDecodeClient, accumulate
from scorer_svc.methods import SCORING_CHOICES
from specdecode.health import ServiceUnreachableError
from specdecode.limits import MAX_K
from specdecode.auth import read_tokens
from specdecode.device import DEVICE_CHOICES, DTYPE_CHOICES, DeviceUnavailableError
from specdecode.model_info import IncompatibleModelsError
from specdecode.tls import TlsFiles
from specdecode.logs import configure_logging
from specdecode.otel_setup import configure
from specdecode.tracing import parse_trace_steps
from orchestrator.config import ASYNC_DRAFTING, SPECULATION
from specdecode_stack.local import LocalStack, StackConfig

if TYPE_CHECKING:
    from specdecode.server import ServerOptions

STARTUP_ERRORS = (ServiceUnreachableError, IncompatibleModelsError, DeviceUnavailableError,
                  OSError, ValueError)  # OSError: a file or port
DEFAULTS = StackConfig()  # the defaults `serve`, `up`, `demo` and `generate` share


def opt(*names, **kw):
    """An option that also reads SPECDECODE_<NAME> from the environment."""
    long = next(n for n in names if n.startswith("--")).split("/")[0]  # --x/--no-x: X
    return click.option(*names, envvar="SPECDECODE_" + long[2:].upper().replace("-", "_"),
                        show_default=True, show_envvar=True, **kw)


class WholeText(click.types.StringParamType):
    """A repeatable option's text whose environment variable is one value, not split on
    whitespace as click does by default (a stop string is often "\\n\\n" or has spaces)."""

    envvar_list_splitter = "\0"  # cannot occur in an environment variable


def option_group(*options):
    """One decorator for several options, listed in the order --help shows them."""
    def decorate(fn):
        for o in reversed(options):
            fn = o(fn)
        return fn
    return decorate


def server_options(default_port: int):
    return option_group(
        opt("--host", default="127.0.0.1", help="Address to bind (0.0.0.0 in a container)."),
        opt("--port", default=default_port, type=int, help="gRPC port (0 = any free port)."),
        opt("--metrics-port", default=0, type=int,
            help="Prometheus /metrics HTTP port (0 = off)."),
        opt("--grace-seconds", default=20.0, type=float,
            help="On SIGTERM, how long in-flight requests may take to finish."),
        opt("--max-message-mb", default=64, type=int, help="Largest gRPC message, MiB."),
        opt("--metrics-host", default=None,
            help="Address of the /metrics endpoint (default: --host), e.g. an internal "
                 "interface the scraper reaches."),
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
        opt("--reflection/--no-reflection", default=True,
            help="Serve gRPC server reflection."),
    )


def _size(ctx, param, value) -> int | None:
    try:
        from specdecode.model_loading import parse_size
        return None if value is None else parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


model_options = option_group(
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
    opt("--enforce-eager", is_flag=True, default=False,
        help="Do not capture CUDA graphs for decode and verify (always eager on CPU)."),
)


telemetry_options = option_group(
    opt("--trace-console", is_flag=True, default=False,
        help="Also print every span to stdout (tracing is otherwise configured by the "
             "OTEL_* environment variables, and off without them)."),
    opt("--log-format", default="json", type=click.Choice(["json", "text"]),
        help="Log lines on stderr: JSON objects (with trace_id/span_id) or plain text."),
)


service_limit_options = option_group(
    opt("--max-batch-seqs", default=256, type=click.IntRange(1),
        help="Most sequences in one call (at least the orchestrator's "
             "--max-running-requests)."),
    opt("--max-speculative-tokens", default=MAX_K, type=click.IntRange(0),
        help="Most draft tokens per sequence (k) in one call."),
    opt("--max-batch-tokens", default=0, type=click.IntRange(0),
        help="Most token ids in one call (0 = --max-batch-seqs x the max model length)."),
)


admission_options = option_group(
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
)


def _trace_steps(ctx, param, value) -> int:
    try:
        return parse_trace_steps(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _run_server(role: str, run, trace_console: bool = False, log_format: str = "json") -> None:
    """Logging and telemetry for one server process, then `run()` (a coroutine factory)
    until SIGTERM; spans and metrics are flushed on the way out."""
    configure_logging(f"specdecode-{role}", log_format)
    telemetry = None
    try:
        telemetry = configure(role, console=trace_console)
        asyncio.run(run())
    except STARTUP_ERRORS as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    finally:
        if telemetry is not None:
            telemetry.shutdown()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specdecode", prog_name="specdecode")
def main() -> None:
    """specdecode: speculative decoding as a gRPC proposer/scorer pair and an orchestrator."""


@main.group()
def serve() -> None:
    """Run one service in the foreground."""


def _server(host, port, metrics_port, grace_seconds, max_message_mb, metrics_host, tls_cert,
            tls_key, tls_ca, auth_token_file, reflection, **extra) -> ServerOptions:
    from specdecode.server import ServerOptions
    if tls_ca and not tls_cert:
        raise click.UsageError("--tls-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
    return ServerOptions(host, port, metrics_port, grace_seconds, max_message_mb,
                         tls=TlsFiles(tls_cert, tls_key, tls_ca),
                         auth_token_file=auth_token_file, reflection=reflection,
                         metrics_host=metrics_host, **extra)


DRAFT_VOCAB_HELP = ("Draft model only: compute logits for this many most frequent token ids "
                    "(BPE merge rank), -inf for the rest; a vocabulary no larger is left "
                    "whole; 0 = the whole vocabulary. Output stays lossless.")
DRAFT_CONFIDENCE_HELP = ("Draft model only: stop a sequence's draft after a token whose "
                         "probability under the draft (greedy: its softmax; sampled: the "
                         "distribution's largest) is below this; 0 = always draft k tokens. "
                         "Output stays lossless.")
ASYNC_DRAFTING_HELP = ("Draft the next proposal while the scorer verifies this one (used only "
                       "when the verified prefix is the one it was drafted from; same "
                       "output): auto where the speculation policy prices it faster (never "
                       "when proposer and scorer share CPU cores), on always, off lockstep.")


@serve.command("proposer")
@opt("--model", default=DEFAULTS.draft_model, help="Draft model directory or .gguf, or 'ngram'.")
@opt("--draft-vocab-size", default=DEFAULTS.draft_vocab_size, type=click.IntRange(0),
     help=DRAFT_VOCAB_HELP)
@opt("--draft-confidence", default=DEFAULTS.draft_confidence, type=click.FloatRange(0, 1),
     help=DRAFT_CONFIDENCE_HELP)
@model_options
@service_limit_options
@server_options(50052)
@telemetry_options
def serve_proposer(model, draft_vocab_size, draft_confidence, device, dtype, max_model_len,
                   kv_cache_memory, max_num_seqs, enforce_eager, trace_console, log_format,
                   max_batch_seqs, max_speculative_tokens, max_batch_tokens, **server) -> None:
    """The proposer service (draft model or n-gram)."""
    from proposer_svc.serve import serve_proposer as run
    from specdecode.limits import ServiceLimits
    from specdecode.model_loading import ModelOptions
    options = ModelOptions(model, device, dtype, max_model_len, kv_cache_memory, max_num_seqs,
                           enforce_eager)
    limits = ServiceLimits(max_batch_seqs, max_speculative_tokens, max_batch_tokens)
    _run_server("proposer", lambda: run(_server(**server), options, draft_vocab_size, limits,
                                        draft_confidence),
                trace_console, log_format)


@serve.command("scorer")
@opt("--model", default="default",
     help="Target model directory or .gguf ('default' = SmolLM2-135M-Instruct).")
@opt("--scoring", default=DEFAULTS.scoring, type=click.Choice(SCORING_CHOICES),
     help="auto: multi-query or batch expansion per call, whichever the measured forward "
          "costs say is cheaper.")
@model_options
@service_limit_options
@server_options(50053)
@telemetry_options
def serve_scorer(model, scoring, device, dtype, max_model_len, kv_cache_memory, max_num_seqs,
                 enforce_eager, trace_console, log_format, max_batch_seqs, max_speculative_tokens,
                 max_batch_tokens, **server) -> None:
    """The scorer service (the target model)."""
    from scorer_svc.serve import serve_scorer as run
    from specdecode.limits import ServiceLimits
    from specdecode.model_loading import ModelOptions
    options = ModelOptions(model, device, dtype, max_model_len, kv_cache_memory, max_num_seqs,
                           enforce_eager)
    limits = ServiceLimits(max_batch_seqs, max_speculative_tokens, max_batch_tokens)
    _run_server("scorer", lambda: run(_server(**server), options, scoring, limits),
                trace_console, log_format)


@serve.command("orchestrator")
@opt("--proposer", default="127.0.0.1:50052",
     help="Proposer replicas: HOST:PORT[,HOST:PORT...]; a name resolving to several addresses "
          "(a headless Service) is one replica per address.")
@opt("--scorer", default="127.0.0.1:50053",
     help="Scorer replicas: HOST:PORT[,HOST:PORT...]; a name resolving to several addresses "
          "(a headless Service) is one replica per address.")
@opt("--tokenizer", default="default",
     help="Tokenizer directory or .gguf ('default' = SmolLM2's, 'none' = token ids only).")
@opt("--num-speculative-tokens", default=DEFAULTS.num_speculative_tokens,
     type=click.IntRange(0, MAX_K),
     help="Draft tokens per step (k): the most with --speculation adaptive.")
@opt("--speculation", default=DEFAULTS.speculation, type=click.Choice(SPECULATION),
     help="adaptive: k per sequence and step (0 included) from its acceptance and the "
          "services' measured forward costs; fixed: always --num-speculative-tokens.")
@opt("--connect-timeout", default=60.0, type=float,
     help="Seconds to wait for the proposer and scorer at start.")
@opt("--default-max-tokens", default=256, type=click.IntRange(1),
     help="max_tokens for requests that leave it 0.")
@opt("--trace-steps", default="all", callback=_trace_steps,
     help="Which step spans to keep when tracing: all, none (request spans only) or N "
          "(every Nth step).")
@opt("--proposer-timeout", default=0.0, type=click.FloatRange(0),
     help="Seconds a step waits for its proposals; past it the step goes on without "
          "speculation (same output). 0 = sized from the step's work.")
@opt("--scorer-timeout", default=0.0, type=click.FloatRange(0),
     help="Seconds one scoring call may take before it is retried on another replica. "
          "0 = sized from the step's work.")
@opt("--scorer-retry-timeout", default=10.0, type=click.FloatRange(0),
     help="Seconds a step retries failed scoring calls (with back-off, on the replicas up) "
          "before its streams fail with UNAVAILABLE.")
@opt("--health-interval", default=1.0, type=click.FloatRange(0.05),
     help="Seconds between health checks of every proposer and scorer replica (a replica "
          "that failed rejoins after one).")
@opt("--resolve-interval", default=10.0, type=click.FloatRange(0.1),
     help="Seconds between DNS look-ups of --proposer and --scorer (replicas come and go).")
@opt("--http-port", default=8000, type=click.IntRange(0, 65535),
     help="Port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
          "/v1/models, /health) on --host; 0 = off.")
@opt("--service-tls-ca", default=None, type=click.Path(dir_okay=False),
     help="PEM CA that signs the proposer's and scorer's certificates: connect to them over "
          "TLS (checking the certificate against the --proposer/--scorer host name), "
          "presenting --service-tls-cert (default --tls-cert) as the client certificate.")
@opt("--service-tls-cert", default=None, type=click.Path(dir_okay=False),
     help="Client certificate for the proposer and scorer (default: --tls-cert).")
@opt("--service-tls-key", default=None, type=click.Path(dir_okay=False),
     help="Private key of --service-tls-cert (default: --tls-key).")
@opt("--service-token-file", default=None, type=click.Path(dir_okay=False),
     help="File whose first token is sent as a bearer token to the proposer and scorer "
          "(their --auth-token-file), for clusters without mutual TLS.")
@opt("--sequence-deltas/--no-sequence-deltas", default=True,
     help="After a sequence's first step, send each service replica only the tokens appended "
          "since it last received the sequence, with the prefix's length and hash (a replica "
          "that lacks the prefix gets the sequence in full); off = full token ids every step.")
@opt("--overlap/--no-overlap", default=False,
     help="Split the running sequences into two groups that alternate, so the proposer drafts "
          "one while the scorer verifies the other (same output; pays when they are on "
          "different hosts or cores; prompts are then not prefilled in chunks).")
@opt("--async-drafting", default=DEFAULTS.async_drafting, type=click.Choice(ASYNC_DRAFTING),
     help=ASYNC_DRAFTING_HELP)
@admission_options
@server_options(DEFAULTS.port)
@telemetry_options
def serve_orchestrator(proposer, scorer, tokenizer, num_speculative_tokens, speculation,
                       connect_timeout,
                       default_max_tokens, trace_steps, proposer_timeout, scorer_timeout,
                       scorer_retry_timeout, health_interval, resolve_interval, http_port,
                       trace_console, log_format, service_tls_ca, service_tls_cert,
                       service_tls_key, service_token_file, max_prompt_tokens,
                       max_running_requests, max_queued_requests, max_num_batched_tokens,
                       sequence_deltas, overlap, async_drafting, **server) -> None:
    """The orchestrator: the public SpecDecodeService API (gRPC) and the OpenAI-compatible
    HTTP API."""
    from orchestrator.config import (AdmissionConfig, OrchestratorConfig, ResilienceOptions,
                                     ServiceSecurity)
    from orchestrator.serve import serve_orchestrator as run

    def start():
        tls = None
        if service_tls_ca:
            tls = TlsFiles(service_tls_cert or server["tls_cert"],
                           service_tls_key or server["tls_key"], service_tls_ca)
        token = None
        if service_token_file:
            tokens = read_tokens(service_token_file)
            if not tokens:
                raise ValueError(f"--service-token-file: {service_token_file} lists no token")
            token = tokens[0]
        admission = AdmissionConfig(max_prompt_tokens, max_running_requests,
                                    max_queued_requests, max_num_batched_tokens,
                                    default_max_tokens)
        return run(OrchestratorConfig(
            server=_server(**server, max_receive_bytes=admission.max_request_bytes),
            proposer=proposer, scorer=scorer, tokenizer=tokenizer,
            num_speculative_tokens=num_speculative_tokens, speculation=speculation,
            connect_timeout_s=connect_timeout, trace_every=trace_steps, http_port=http_port,
            sequence_deltas=sequence_deltas, overlap=overlap, async_drafting=async_drafting,
            resilience=ResilienceOptions(proposer_timeout, scorer_timeout, scorer_retry_timeout,
                                         health_interval, resolve_interval),
            security=ServiceSecurity(tls, token), admission=admission))
    _run_server("orchestrator", start, trace_console, log_format)


stack_options = option_group(
    click.option("--target-model", default=DEFAULTS.target_model,
                 help="Target model directory or .gguf (default: SmolLM2-135M-Instruct)."),
    click.option("--draft-model", default=DEFAULTS.draft_model, show_default=True,
                 help="Draft model directory or .gguf, or 'ngram'."),
    click.option("--device", default=DEFAULTS.device, type=click.Choice(DEVICE_CHOICES),
                 show_default=True),
    click.option("--dtype", default=DEFAULTS.dtype, type=click.Choice(DTYPE_CHOICES),
                 show_default=True),
    click.option("--scoring", default=DEFAULTS.scoring, type=click.Choice(SCORING_CHOICES),
                 show_default=True),
    click.option("--num-speculative-tokens", default=DEFAULTS.num_speculative_tokens,
                 type=click.IntRange(0, MAX_K), show_default=True,
                 help="The most draft tokens per step."),
    opt("--speculation", default=DEFAULTS.speculation, type=click.Choice(SPECULATION),
        help="adaptive: k per sequence and step from measured costs; fixed: always k."),
    opt("--draft-vocab-size", default=DEFAULTS.draft_vocab_size, type=click.IntRange(0),
        help=DRAFT_VOCAB_HELP),
    opt("--draft-confidence", default=DEFAULTS.draft_confidence, type=click.FloatRange(0, 1),
        help=DRAFT_CONFIDENCE_HELP),
    opt("--async-drafting", default=DEFAULTS.async_drafting, type=click.Choice(ASYNC_DRAFTING),
        help=ASYNC_DRAFTING_HELP),
    click.option("--port", default=DEFAULTS.port, type=int, show_default=True,
                 help="The orchestrator's port (0 = any free port)."),
)


def _stack(target_model, draft_model, device, dtype, scoring, num_speculative_tokens,
           speculation, draft_vocab_size, draft_confidence, async_drafting, port) -> LocalStack:
    return LocalStack(StackConfig(target_model=target_model, draft_model=draft_model,
                                  device=device, dtype=dtype, scoring=scoring,
                                  num_speculative_tokens=num_speculative_tokens,
                                  speculation=speculation, draft_vocab_size=draft_vocab_size,
                                  draft_confidence=draft_confidence,
                                  async_drafting=async_drafting, port=port))


def _start(stack: LocalStack) -> None:
    try:
        stack.start()
    except RuntimeError as exc:
        logs = f" (server logs: {stack.config.log_file})" if stack.config.log_file else ""
        click.echo(f"error: the local stack did not start: {exc}{logs}", err=True)
        sys.exit(2)


@main.command()
@stack_options
@opt("--http-port", default=8000, type=click.IntRange(0, 65535),
     help="Port of the orchestrator's OpenAI-compatible HTTP API; 0 = off.")
@opt("--tls-cert", default=None, type=click.Path(exists=True, dir_okay=False),
     help="PEM certificate for all three servers (valid for 127.0.0.1): serve TLS.")
@opt("--tls-key", default=None, type=click.Path(exists=True, dir_okay=False),
     help="PEM private key of --tls-cert.")
@opt("--tls-ca", default=None, type=click.Path(exists=True, dir_okay=False),
     help="PEM CA of --tls-cert: the proposer and scorer then accept only clients with a "
          "certificate it signed (the orchestrator presents --tls-cert).")
@opt("--auth-token-file", default=None, type=click.Path(exists=True, dir_okay=False),
     help="Bearer tokens the public API accepts, one per line.")
def up(http_port, tls_cert, tls_key, tls_ca, auth_token_file, **kw) -> None:
    """Start proposer, scorer and orchestrator on 127.0.0.1; Ctrl-C stops all three."""
    stack = _stack(**kw)
    stack.config.http_port = http_port
    try:
        stack.config.tls = TlsFiles(tls_cert, tls_key, tls_ca)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if tls_ca and not tls_cert:
        raise click.UsageError("--tls-ca needs --tls-cert and --tls-key")
    stack.config.auth_token_file = auth_token_file
    _start(stack)
    http = f", OpenAI API on http://127.0.0.1:{http_port}/v1" if http_port else ""
    click.echo(f"specdecode is serving on {stack.address}{http} (Ctrl-C to stop)")
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    while not stopping and all(p.poll() is None for p in stack.processes.values()):
        time.sleep(0.5)
    codes = stack.stop()
    click.echo(f"stopped: {codes}")


def _print_stream(address: str, prompt: str, as_json: bool, tls_ca: str | None = None,
                  token: str | None = None, **params) -> GenerateResult:
    """Stream a generation: its text to stdout as it comes (one JSON object at the end with
    `as_json`), then a summary line to stderr."""
    result = GenerateResult()
    start = time.perf_counter()
    with SpecDecodeClient(address, tls_ca=tls_ca, token=token) as client:
        try:
            for response in client.stream(prompt, **params):
                accumulate(result, response)
                if not as_json:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
        except grpc.RpcError as exc:
            click.echo(f"\nerror: {exc.code().name}: {exc.details()}", err=True)
            sys.exit(1)
    seconds = time.perf_counter() - start
    click.echo(json.dumps(result.as_json()) if as_json else "")
    u = result.usage
    rate = u.acceptance_rate
    click.secho(f"{u.completion_tokens} tokens in {seconds:.2f}s "
                f"({u.completion_tokens / seconds:.1f} tokens/s), acceptance rate "
                f"{'n/a' if rate != rate else f'{rate:.0%}'}, {u.steps} steps, "
                f"finish: {result.finish_reason}", err=True, bold=True)
    return result


@main.command()
@opt("--address", default=f"127.0.0.1:{DEFAULTS.port}", help="The orchestrator, HOST:PORT.")
@opt("--max-tokens", default=64, type=click.IntRange(1), help="Most tokens to generate.")
@opt("--temperature", default=0.0, type=click.FloatRange(0), help="0 = greedy.")
@opt("--top-k", default=0, type=click.IntRange(0), help="0 = the whole vocabulary.")
@opt("--top-p", default=1.0, type=click.FloatRange(0, 1, min_open=True), help="Nucleus mass.")
@opt("--seed", default=None, type=int, help="Sampling seed (unset = nondeterministic).")
@opt("--stop", multiple=True, type=WholeText(),
     help="A string that ends the generation (repeatable; SPECDECODE_STOP holds one, "
          "spaces and newlines included).")
@opt("--json", "as_json", is_flag=True, default=False,
     help="Print one JSON object (text, token ids, usage) instead of streaming text.")
@opt("--tls-ca", default=None, type=click.Path(dir_okay=False),
     help="Connect over TLS, trusting this CA (PEM).")
@opt("--token", default=None, help="Bearer token for a server started with --auth-token-file.")
@click.argument("prompt")
def generate(address, prompt, as_json, stop, tls_ca, token, **params) -> None:
    """Stream a completion of PROMPT ('-' reads it from stdin) from a running orchestrator.

    The text goes to stdout, a summary line to stderr."""
    if prompt == "-":
        prompt = sys.stdin.read()
    _print_stream(address, prompt, as_json, tls_ca, token, stop=stop, **params)


# An editing task: the answer repeats much of the prompt, which the default n-gram proposer
# finds (prompt lookup), so the demo shows speculation paying; on free-form prompts the
# stack mostly decodes plainly, as adaptive k finds that speculation does not pay there.
DEMO_PROMPT = ("<|im_start|>user\nRename the variable a to prev in this Python function:\n\n"
               "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
               "        a, b = b, a + b\n    return a<|im_end|>\n<|im_start|>assistant\n")


@main.command()
@stack_options
@click.option("--max-tokens", default=64, show_default=True, type=int)
def demo(max_tokens, **kw) -> None:
    """Start the local stack on the defaults, stream one generation, shut down."""
    stack = _stack(**kw)
    log_file = Path(tempfile.mkdtemp(prefix="specdecode-demo-")) / "servers.log"
    log_file.write_text("")
    stack.config.log_file = str(log_file)
    click.echo("starting proposer, scorer and orchestrator (the first run converts the "
               f"default model, ~20 s; server logs: {log_file})...")
    _start(stack)
    try:
        click.echo(f"serving on {stack.address}; streaming a generation:\n")
        _print_stream(stack.address, DEMO_PROMPT, False, max_tokens=max_tokens)
    finally:
        codes = stack.stop()
    click.echo(f"stopped all three services (exit codes {codes})")
    if any(codes.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
