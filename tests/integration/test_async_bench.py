"""bench/async_bench.py in CI size (tiny pair, seconds of work): the two-host setup's stacks
start pinned, every path runs, and its outputs are compared with HF target-only's and with
lockstep's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_async_bench_runs_every_path_and_checks_its_outputs(tmp_path):
    r = subprocess.run(
        [sys.executable, "bench/async_bench.py", "--pair", "tiny", "--parts", "two-hosts,hf",
         "--classes", "qa", "--max-tokens", "6", "--lockstep-k", "", "--hf-k", "",
         "--dtype", "float32", "--results", str(tmp_path)], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {(row["setup"], row["path"]): row for row in json.loads(
        (tmp_path / "async_tiny_float32.json").read_text())["rows"]}
    for key in (("two hosts", "defaults"), ("two hosts", "lockstep k<=8"),
                ("one core", "HF target-only"), ("one core", "HF assisted, defaults")):
        assert key in rows, sorted(rows)
    # The tiny target ends its Q&A answer within 4 tokens: the stack is compared up to there.
    equal, compared = map(int, rows[("two hosts", "defaults")]["equal"].split("/"))
    assert 1 <= compared <= 4 and equal == compared
    assert rows[("two hosts", "lockstep k<=8")]["vs_lockstep_best"] == 1.0
    # Greedy: every stack path gives the tokens lockstep at adaptive k gave, to the end.
    assert rows[("two hosts", "defaults")]["same_as_lockstep"] == "1/1"
    assert rows[("one core", "HF target-only")]["same_as_lockstep"] == "-"
