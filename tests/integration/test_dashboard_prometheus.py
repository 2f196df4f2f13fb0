"""The dashboard against a real Prometheus scraping `specdecode up --metrics-port P`
(bench/telemetry_bench.py dashboard on the tiny pair): `up` prints each server's address and
metrics port and little else; every panel's query returns finite data while the stack speculates,
and the acceptance panels say "no speculation" (their NaN mapping) while nothing is drafted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_dashboard_query_has_data_in_a_real_prometheus():
    r = subprocess.run([sys.executable, "bench/telemetry_bench.py", "dashboard", "--pair", "tiny",
                        "--max-tokens", "16"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    result = json.loads((ROOT / "bench" / "results" / "dashboard_check.json").read_text())
    # `up`'s console: one start line per server with its metrics port (P, P+1, P+2: the
    # ports Prometheus scraped), a line before and after, no JSON log lines.
    up, first = result["up"], result["up"]["first_metrics_port"]
    assert up["metrics_ports"] == {"orchestrator": first, "proposer": first + 1,
                                   "scorer": first + 2}
    assert [line.split()[0] for line in up["stdout"]] == [
        "starting", "scorer", "proposer", "orchestrator", "specdecode", "stopped:"]
    assert up["exit_code"] == 0 and "{" not in up["stderr"], up["stderr"][-2000:]
    dashboard = json.loads((ROOT / "dashboards" / "specdecode.json").read_text())
    targets = sum(len(p.get("targets", [])) for p in dashboard["panels"])
    assert len(result["speculating"]) == targets and result["drafted"] > 0
    assert all(c["ok"] and c["series"] >= 1 for c in result["speculating"])
    # The refused HTTP requests (a 400 and a 404) are visible as such.
    (errors,) = [c for c in result["speculating"] if c["panel"] == "HTTP 4xx / 5xx responses"]
    assert errors["series"] == 2 and all(v > 0 for v in errors["values"])
    # The two model variables resolve separately: the tiny pair's target and draft directories.
    assert result["variables"]["model"] == "target" and result["variables"]["draft"] == "draft"
    idle = {(c["panel"], c["legend"]): c["shown"] for c in result["idle"]}
    for panel in ("Draft acceptance rate", "System efficiency", "Acceptance by draft position"):
        assert [s for (p, _), s in idle.items() if p == panel] and all(
            s == "no speculation (0 drafted)" for (p, _), s in idle.items() if p == panel), idle
