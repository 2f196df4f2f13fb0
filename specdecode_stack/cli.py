"""The `specdecode` command: serve one service, run the local stack, generate, demo.

Every option of `serve` and `generate` can also be set as SPECDECODE_<OPTION> (e.g.
SPECDECODE_PORT, SPECDECODE_ADDRESS). The options, in the groups --help shows, are
specdecode_stack.options; defaults shared with the local stack come from StackConfig.

The client path (`generate`, `--help`, `--version`) imports neither torch nor transformers:
each command imports what it runs (docs/design.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
import grpc

from specdecode.api.client import GenerateResult, SpecDecodeClient, accumulate
from specdecode.serving.auth import read_tokens
from specdecode.executor.device import DeviceUnavailableError
from specdecode.serving.health import ServiceUnreachableError
from specdecode.telemetry.logs import configure_logging
from specdecode.model_info import IncompatibleModelsError
from specdecode.telemetry.otel_setup import configure
from specdecode.serving.tls import TlsFiles
from specdecode_stack.local import LocalStack, StackConfig
from specdecode_stack.options import (DEFAULTS, Sectioned, WholeText, admission_options,
                                      demo_serving_options, draft_options, http_api_options,
                                      model_options, opt, option_group,
                                      orchestrator_model_options,
                                      orchestrator_service_options, server_options,
                                      server_security_options, service_limit_options,
                                      service_security_options,
                                      stack_log_options, stack_model_options,
                                      stack_security_options, stack_serving_options,
                                      stack_speculation_options, target_options,
                                      telemetry_options, trace_steps_option)

if TYPE_CHECKING:
    from specdecode.serving.server import ServerOptions

STARTUP_ERRORS = (ServiceUnreachableError, IncompatibleModelsError, DeviceUnavailableError,
                  OSError, ValueError)  # OSError: a file or port


def _run_server(role: str, run, trace_console: bool = False, log_format: str = "json",
                log_level: str = "info") -> None:
    """Logging and telemetry for one server process, then `run()` (a coroutine factory)
    until SIGTERM; spans and metrics are flushed on the way out."""
    configure_logging(f"specdecode-{role}", log_format, getattr(logging, log_level.upper()))
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
    from specdecode.serving.server import ServerOptions
    if tls_ca and not tls_cert:
        raise click.UsageError("--tls-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
    return ServerOptions(host, port, metrics_port, grace_seconds, max_message_mb,
                         tls=TlsFiles(tls_cert, tls_key, tls_ca),
                         auth_token_file=auth_token_file, reflection=reflection,
                         metrics_host=metrics_host, **extra)


def _service(run, model, device, dtype, max_model_len, kv_cache_memory, max_num_seqs,
             compile_mode, compile_cache, cost_cache, deterministic, calibration_width,
             tls_client_auth, max_batch_seqs, max_speculative_tokens, max_batch_tokens,
             sequence_lease_seconds, **server):
    """run(ServerOptions, ModelOptions, ServiceLimits): the proposer or scorer, after its TLS
    rule (specdecode.serving.tls.check_client_auth, inside the run: a refusal is one line, the
    warning a log line)."""
    from specdecode.serving.limits import ServiceLimits
    from specdecode.models.model_loading import ModelOptions, resolve_deterministic
    from specdecode.serving.tls import check_client_auth
    options = _server(**server)
    check_client_auth(options.tls, tls_client_auth)
    return run(options, ModelOptions(model, device, dtype, max_model_len, kv_cache_memory,
                                     max_num_seqs, compile_mode,
                                     resolve_deterministic(deterministic, dtype),
                                     calibration_width, compile_cache, cost_cache),
               ServiceLimits(max_batch_seqs, max_speculative_tokens, max_batch_tokens,
                             sequence_lease_seconds))


@serve.command("proposer", cls=Sectioned)
@draft_options
@model_options
@service_limit_options
@server_options(50052)
@service_security_options
@telemetry_options()
def serve_proposer(draft_vocab_size, draft_confidence, trace_console, log_format, log_level,
                   **service) -> None:
    """The proposer service (draft model or n-gram)."""
    from proposer_svc.serve import serve_proposer as run
    _run_server("proposer", lambda: _service(
        lambda options, model, limits: run(options, model, draft_vocab_size, limits,
                                           draft_confidence), **service),
                trace_console, log_format, log_level)


@serve.command("scorer", cls=Sectioned)
@target_options
@model_options
@service_limit_options
@server_options(50053)
@service_security_options
@telemetry_options()
def serve_scorer(scoring, trace_console, log_format, log_level, **service) -> None:
    """The scorer service (the target model)."""
    from scorer_svc.serve import serve_scorer as run
    _run_server("scorer", lambda: _service(
        lambda options, model, limits: run(options, model, scoring, limits), **service),
                trace_console, log_format, log_level)


def _service_security(service_tls_ca, service_tls_cert, service_tls_key, service_token_file,
                      tls_cert, tls_key):
    """How the orchestrator reaches the proposer and scorer: TLS and/or a bearer token."""
    from orchestrator.config import ServiceSecurity
    tls = None
    if service_tls_ca:
        tls = TlsFiles(service_tls_cert or tls_cert, service_tls_key or tls_key, service_tls_ca)
    token = None
    if service_token_file:
        tokens = read_tokens(service_token_file)
        if not tokens:
            raise ValueError(f"--service-token-file: {service_token_file} lists no token")
        token = tokens[0]
    return ServiceSecurity(tls, token)


@serve.command("orchestrator", cls=Sectioned)
@orchestrator_model_options
@orchestrator_service_options
@http_api_options
@admission_options
@server_options(DEFAULTS.port)
@server_security_options
@telemetry_options()
@trace_steps_option
def serve_orchestrator(proposer, scorer, tokenizer, served_model_name, num_speculative_tokens,
                       speculation, connect_timeout, default_max_tokens, trace_steps,
                       proposer_timeout, scorer_timeout, scorer_retry_timeout, health_interval,
                       resolve_interval, http_port, trace_console, log_format, log_level,
                       service_tls_ca, service_tls_cert, service_tls_key, service_token_file,
                       max_prompt_tokens, max_running_requests, max_queued_requests,
                       max_num_batched_tokens, grammar_compile_timeout, sequence_deltas, overlap,
                       async_drafting, http_max_connections, http_header_timeout,
                       http_keep_alive_timeout, stream_write_timeout, keepalive_interval,
                       keepalive_timeout, **server) -> None:
    """The orchestrator: the public SpecDecodeService API (gRPC) and the OpenAI-compatible
    HTTP API."""
    from orchestrator.config import (AdmissionConfig, HttpLimits, OrchestratorConfig,
                                     ResilienceOptions)
    from orchestrator.serve import serve_orchestrator as run

    def start():
        admission = AdmissionConfig(max_prompt_tokens, max_running_requests,
                                    max_queued_requests, max_num_batched_tokens,
                                    default_max_tokens)
        return run(OrchestratorConfig(
            server=_server(**server, max_receive_bytes=admission.max_request_bytes),
            proposer=proposer, scorer=scorer, tokenizer=tokenizer,
            served_model_name=served_model_name,
            num_speculative_tokens=num_speculative_tokens, speculation=speculation,
            connect_timeout_s=connect_timeout, trace_every=trace_steps, http_port=http_port,
            http=HttpLimits(http_max_connections, http_header_timeout, http_keep_alive_timeout),
            sequence_deltas=sequence_deltas, overlap=overlap, async_drafting=async_drafting,
            grammar_compile_timeout_s=grammar_compile_timeout,
            stream_write_timeout_s=stream_write_timeout,
            resilience=ResilienceOptions(proposer_timeout, scorer_timeout, scorer_retry_timeout,
                                         health_interval, resolve_interval, keepalive_interval,
                                         keepalive_timeout),
            security=_service_security(service_tls_ca, service_tls_cert, service_tls_key,
                                       service_token_file, server["tls_cert"],
                                       server["tls_key"]),
            admission=admission))
    _run_server("orchestrator", start, trace_console, log_format, log_level)


def _start(stack: LocalStack, on_serving=None) -> None:
    try:
        stack.start(on_serving=on_serving)
    except RuntimeError as exc:
        logs = f" (server logs: {stack.config.log_file})" if stack.config.log_file else ""
        click.echo(f"error: the local stack did not start: {exc}{logs}", err=True)
        sys.exit(2)


def _start_line(stack: LocalStack, role: str) -> str:
    """A server's human start line: its address, its metrics, what it serves."""
    c = stack.config
    what = {"scorer": f"target {c.target_model or 'SmolLM2-135M-Instruct'}",
            "proposer": f"draft {c.draft_model}",
            "orchestrator": (f"OpenAI API http://{stack.connect_host}:{c.http_port}/v1"
                             if c.http_port else "gRPC API only")}[role]
    metrics = f"http://{stack.connect_host}:{stack.metrics_ports[role]}/metrics"
    return (f"{role:<12} {stack.service_addresses[role]:<21} metrics {metrics:<36} {what}")


@main.command(cls=Sectioned)
@stack_model_options
@stack_speculation_options
@stack_serving_options
@stack_security_options
@stack_log_options
def up(tls_cert, tls_key, tls_ca, **kw) -> None:
    """Start proposer, scorer and orchestrator; Ctrl-C stops all three."""
    if bool(tls_ca) != bool(tls_cert):
        raise click.UsageError("--tls-cert, --tls-key and --tls-ca go together: the proposer "
                               "and scorer accept only mutual-TLS peers")
    try:
        config = StackConfig(**kw, tls=TlsFiles(tls_cert, tls_key, tls_ca))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    stack = LocalStack(config)
    click.echo(f"starting scorer, proposer and orchestrator on {config.host} ...")
    _start(stack, on_serving=lambda role: click.echo(_start_line(stack, role)))
    click.echo(f"specdecode is serving on {stack.address} (Ctrl-C to stop)")
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    while not stopping and all(p.poll() is None for p in stack.processes.values()):
        time.sleep(0.5)
    codes = stack.stop()
    click.echo(f"stopped: {codes}")


def speculation_summary(u) -> str:
    """How much of a run speculated: `acceptance 100% of 4 drafted in 47 steps` (a mostly
    plain run does not read as fully speculative), `no draft token in 47 steps`."""
    if not u.draft_tokens:
        return f"no draft token in {u.steps} steps"
    return f"acceptance {u.acceptance_rate:.0%} of {u.draft_tokens} drafted in {u.steps} steps"


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
    click.secho(f"{result.usage.completion_tokens} tokens in {seconds:.2f}s "
                f"({result.usage.completion_tokens / seconds:.1f} tokens/s), "
                f"{speculation_summary(result.usage)}, finish: {result.finish_reason}",
                err=True, bold=True)
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


@main.command(cls=Sectioned)
@stack_model_options
@stack_speculation_options
@demo_serving_options
@option_group("Generation", click.option("--max-tokens", default=64, show_default=True, type=int,
                                         help="Tokens of the generation it streams."))
def demo(max_tokens, **kw) -> None:
    """Start the local stack on the defaults, stream one generation, shut down."""
    stack = LocalStack(StackConfig(**kw))
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
