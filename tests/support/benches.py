"""Run a bench/ script at CI size as its own process, from the repository's root."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import ROOT


def run_bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python *args` with this checkout on PYTHONPATH; it must exit 0 (else its stderr)."""
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r
