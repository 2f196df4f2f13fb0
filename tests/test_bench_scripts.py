"""Bench scripts that reach into the engine's internals still run (tiny models, seconds): a
refactor that changes what they call fails here, not on the next day of measurements (the
policy tracer broke once, unseen, when the policy's exploration gained a parameter)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_policy_trace_prints_every_steps_plan_and_the_cost_tables():
    r = subprocess.run(
        [sys.executable, "bench/policy_trace.py", "--pair", "tiny", "--max-tokens", "16",
         "--dtype", "float32"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = re.findall(r"^\s*\d+ k=\[\d+\] .*\| draft x[\d.]+ catch-up x", r.stdout, re.M)
    assert len(steps) >= 4  # 16 tokens: a prompt step, then at least 3 more
    assert re.search(r"^== code: 16 tokens in [\d.]+ s", r.stdout, re.M)
    for table in ("scorer at start-up", "draft at start-up", "scorer at the end",
                  "proposer at the end"):
        assert table in r.stdout
