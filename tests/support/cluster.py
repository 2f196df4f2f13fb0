"""Service processes on 127.0.0.1 that tests start, kill and restart one by one: scorer and
proposer replicas and orchestrators, each on a fixed port (a restarted replica comes back
at the same address), each with a /metrics endpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specdecode_stack.local import free_port, wait_process_serving

# A server's start (imports, model load, calibration) on a 2-core host that other tests'
# servers share: a bf16 orchestrator's took over 120 s in CI once (its log now comes with
# the error).
START_S = 300


class Cluster:
    def __init__(self, model_dirs: dict[str, str], log_dir: Path, *, scorers: int = 1,
                 proposers: int = 1, draft: str = "draft", k: int = 3,
                 orchestrator_args: tuple[str, ...] = (), http: bool = False):
        self.dirs, self.log_dir, self.k = model_dirs, log_dir, k
        # http: the first orchestrator also serves the HTTP API, at self.http
        self.http_port = free_port() if http else 0
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.draft = model_dirs.get(draft, draft)
        self.orchestrator_args = orchestrator_args
        self.ports: dict[str, int] = {}
        self.metrics_ports: dict[str, int] = {}
        self.processes: dict[str, subprocess.Popen] = {}
        self.spawned: dict[str, tuple[str, ...]] = {}  # name -> role and arguments
        self.started: set[str] = set()  # names that reported SERVING once (their port is theirs)
        self.scorers = [f"scorer{i}" for i in range(scorers)]
        self.proposers = ["proposer", *(f"proposer{i}" for i in range(1, proposers))]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def _spawn(self, name: str, role: str, *args: str) -> subprocess.Popen:
        self.spawned[name] = (role, *args)
        self.ports.setdefault(name, free_port())
        self.metrics_ports.setdefault(name, free_port())
        # Several processes share the cores: OpenMP threads sleep rather than spin.
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "specdecode_stack.cli", "serve", role, "--host", "127.0.0.1",
               "--port", str(self.ports[name]), "--metrics-port", str(self.metrics_ports[name]),
               "--log-format", "text", *args]
        with open(self.log_path(name), "a") as log:
            self.processes[name] = subprocess.Popen(cmd, env=env, stdout=log,
                                                    stderr=subprocess.STDOUT)
        return self.processes[name]

    def start_service(self, name: str, wait: bool = True) -> None:
        if name.startswith("scorer"):
            self._spawn(name, "scorer", "--model", self.dirs["target"], "--device", "cpu",
                        "--scoring", "batch-expansion")
        else:
            self._spawn(name, "proposer", "--model", self.draft, "--device", "cpu")
        if wait:
            self.wait_serving(name)

    def start_orchestrator(self, name: str = "orchestrator", *args: str) -> None:
        # Fixed k: the random tiny models accept next to nothing, so adaptive k would stop
        # speculating, and these tests watch speculation go and come back.
        self._spawn(
            name, "orchestrator", "--proposer", ",".join(self.address(p) for p in self.proposers),
            "--scorer", ",".join(self.address(s) for s in self.scorers), "--tokenizer", "none",
            "--num-speculative-tokens", str(self.k), "--speculation", "fixed",
            "--health-interval", "0.5", "--http-port",
            str(self.http_port if name == "orchestrator" else 0), *self.orchestrator_args, *args)
        self.wait_serving(name)

    def wait_serving(self, name: str) -> None:
        """Until `name` reports SERVING (RuntimeError with its log's end if it exits). A first
        start that finds a port taken starts again on new ports: between free_port() and the
        server's bind, seconds later, any process's connection may have taken the port."""
        process = self.processes[name]
        try:
            wait_process_serving(self.address(name), START_S, process, log=self.log_path(name))
        except RuntimeError as exc:
            if name in self.started or "Address already in use" not in str(exc):
                raise
            del self.ports[name], self.metrics_ports[name]
            self._spawn(name, *self.spawned[name])
            wait_process_serving(self.address(name), START_S, self.processes[name],
                                 log=self.log_path(name))
        self.started.add(name)

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self) -> Cluster:
        for name in [*self.scorers, *self.proposers]:
            self.start_service(name, wait=False)
        for name in [*self.scorers, *self.proposers]:
            self.wait_serving(name)
        self.start_orchestrator()
        return self

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes[name]
        process.send_signal(sig)
        process.wait(60)

    def stop(self) -> dict[str, int]:
        """SIGTERM the orchestrators, then all services at once; exit codes."""
        codes = {}
        orchestrators = [n for n in self.processes if n.startswith("orchestrator")]
        for group in (orchestrators, [n for n in self.processes if n not in orchestrators]):
            for name in group:
                if self.processes[name].poll() is None:
                    self.processes[name].send_signal(signal.SIGTERM)
            for name in group:
                try:
                    codes[name] = self.processes[name].wait(30)
                except subprocess.TimeoutExpired:
                    self.processes[name].kill()
                    codes[name] = self.processes[name].wait()
        return codes

    def metrics(self, name: str) -> str:
        url = f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()

    def metric(self, name: str, metric: str, labels: str = "") -> float:
        """One sample's value (0 when absent); labels: a substring of its label set."""
        total = 0.0
        for line in self.metrics(name).splitlines():
            m = re.match(rf"^{re.escape(metric)}(\{{[^}}]*\}})? (\S+)$", line)
            if m and labels in (m.group(1) or ""):
                total += float(m.group(2))
        return total

    def wait_for(self, predicate, timeout_s: float, what: str) -> float:
        """Poll until predicate() holds; seconds it took (AssertionError naming `what`)."""
        start = time.monotonic()
        while not predicate():
            assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s}s"
            time.sleep(0.1)
        return time.monotonic() - start
