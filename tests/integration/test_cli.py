"""The `specdecode` command as a process: --version, a light client path, one-line
start-up errors, demo's logs in a temporary directory it names, and progress bars
kept out of the JSON log stream. (generate against a running stack:
tests/integration/test_services_smollm2.py.)"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from specdecode_stack.local import free_port, wait_process_serving

CLI = [sys.executable, "-m", "specdecode_stack.cli"]


def test_version_prints_the_package_version():
    out = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.strip() == f"specdecode, version {importlib.metadata.version('specdecode')}"


def test_generate_help_loads_neither_torch_nor_transformers():
    """The client path is light: `generate` and its --help import no model code."""
    code = ("import sys\nfrom specdecode_stack.cli import main\ntry:\n"
            "    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "SPECDECODE_ADDRESS" in out.stdout and "--stop" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_metrics_port_in_use_is_a_one_line_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([*CLI, "serve", "proposer", "--port", "0", "--metrics-port",
                              str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert "--metrics-port" in line and str(port) in line


def test_a_taken_http_port_is_the_same_one_line_error_as_a_taken_port():
    """A second orchestrator on a host whose HTTP port is taken (8000, say) stops at once
    with one line naming --http-port, before it looks for its services."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([*CLI, "serve", "orchestrator", "--port", "0", "--http-port",
                              str(port), "--log-format", "text"], capture_output=True,
                             text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "Errno" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"error: --http-port 127.0.0.1:{port} is not available: Address already in use"]


def serve_tiny_proposer(model_dir: str, log_format: str) -> tuple[str, str]:
    """Start `serve proposer` on a tiny model until it serves, stop it: (stdout, stderr)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "SPECDECODE_LOG_FORMAT")}
    proc = subprocess.Popen([*CLI, "serve", "proposer", "--model", model_dir, "--port",
                             str(port), "--log-format", log_format], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_process_serving(f"127.0.0.1:{port}", 120, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out, err


def test_progress_bars_stay_out_of_json_logs_and_on_stderr_in_text_logs(tiny_model_dirs):
    """Loading a model draws transformers' "Loading weights" bar: in text mode it is on
    stderr (never stdout); in JSON mode every stderr line is a JSON log object."""
    out, err = serve_tiny_proposer(tiny_model_dirs["draft"], "text")
    assert "Loading weights" in err and out == ""
    out, err = serve_tiny_proposer(tiny_model_dirs["draft"], "json")
    assert out == "" and "Loading weights" not in err
    lines = [json.loads(line) for line in err.splitlines()]
    assert any(line["message"].startswith("proposer ready") for line in lines)


def test_demo_logs_into_a_temporary_directory_it_names():
    """The server log path is printed before the stack starts, lies in a fresh directory
    under the system's temporary directory, and holds the servers' output (here: the
    scorer's error about a missing model, which fails the start with exit code 2)."""
    out = subprocess.run([*CLI, "demo", "--target-model", "/nonexistent/model.gguf",
                          "--port", "0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    (path,) = set(re.findall(r"server logs: (\S+?\.log)", out.stdout + out.stderr))
    log = Path(path)
    assert log.parent.parent == Path(tempfile.gettempdir())
    assert log.parent.name.startswith("specdecode-demo-") and log.parent.name != "specdecode-demo-"
    assert "/nonexistent/model.gguf" in log.read_text()
