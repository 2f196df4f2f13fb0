"""The `specdecode` command's conventions: --version, one-line start-up errors, and progress
bars kept out of the JSON log stream."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys

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
    assert "--prompt" in out.stdout or "PROMPT" in out.stdout
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


def test_json_logs_turn_progress_bars_off_and_text_logs_keep_them():
    code = ("import sys\n"
            "from specdecode.logs import configure_logging\n"
            "configure_logging('t', sys.argv[1])\n"
            "from transformers.utils import logging\n"
            "print(logging.is_progress_bar_enabled())")
    for fmt, enabled in (("json", "False"), ("text", "True")):
        out = subprocess.run([sys.executable, "-c", code, fmt], capture_output=True, text=True,
                             timeout=120, env={k: v for k, v in os.environ.items()
                                               if k != "HF_HUB_DISABLE_PROGRESS_BARS"})
        assert out.stdout.strip() == enabled, out.stderr
