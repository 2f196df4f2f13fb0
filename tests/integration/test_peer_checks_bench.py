"""bench/wire_bench.py peer-checks runs in CI size (tiny shapes, seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_peer_checks_bench_prints_and_writes_every_row(tmp_path):
    out = tmp_path / "peer_checks.json"
    r = subprocess.run([sys.executable, "bench/wire_bench.py", "peer-checks", "--shapes", "1x2,2x3",
                        "--vocab", "256", "--context", "16", "--repeats", "3", "--out", str(out)],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["B"], row["k"], row["probs"]) for row in rows] == [
        (b, k, p) for b, k in ((1, 2), (2, 3)) for p in ("none", "sparse", "dense")]
    assert all(row["decode_ms"] > 0 and row["checks_ms"] > 0 for row in rows)
    assert "checks/decode" in r.stdout
