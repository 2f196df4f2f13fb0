"""bench/reliability_bench.py soak at CI size (60 s, the tiny pair, a 3 s stream write timeout): mixed greedy
and sampled streams at concurrency 8, 10% cancelled by their clients mid-stream, 5% never
read, the scorer restarted once: no error beyond the clients' own cancels, every never-read
stream cancelled by the server, and no sequence held anywhere afterwards. Two minutes with
the stack's start and drain: beyond the CI budget, so marked slow (run with -m slow)."""

from __future__ import annotations

import json

import pytest

from tests.support.benches import run_bench


@pytest.mark.slow
def test_soak_bench_at_ci_size(tmp_path):
    out = tmp_path / "soak.json"
    run_bench("bench/reliability_bench.py", "soak", "--model", "tiny", "--duration", "60", "--write-timeout", "3",
              "--out", str(out), timeout=900)
    result = json.loads(out.read_text())
    assert result["errors"] == 0, result["error_samples"]
    requests = result["requests"]
    assert requests.get("greedy:ok", 0) and requests.get("sampled:ok", 0), requests
    assert result["write_timeouts"] == requests.get("never_read:sent", 0), result
    assert set(result["held_after"].values()) == {0}, result["held_after"]
    print(f"\nsoak 60 s: {result['total']} requests {requests}, scorer restart "
          f"{result['scorer_restart_s']:.1f}s, RSS at 1 min {result['rss_mib_at_1min']}, "
          f"at the end {result['rss_mib_at_end']}")
