"""The deterministic mode's benches still run at CI size (tiny models, seconds to a minute):
bench/numerics_bench.py: probes, costs and deterministic (the stack)."""

from __future__ import annotations

import json

import pytest

from tests.support.benches import run_bench



@pytest.mark.slow  # a minute of probes; the operators' own checks run in tests/unit
def test_invariance_probes_find_every_row_equal_with_the_mode_on(tmp_path):
    out = tmp_path / "invariance.json"
    r = run_bench("bench/numerics_bench.py", "probes", "--model", "tiny", "--quick",
                  "--dtypes", "bfloat16,float32", "--out", str(out), timeout=900)
    probes = json.loads(out.read_text())["probes"]
    assert {(p["dtype"], p["deterministic"]) for p in probes} == {
        (d, m) for d in ("bfloat16", "float32") for m in (False, True)}
    names = {p["name"].split(" ")[0] for p in probes}
    assert {"linear", "LM", "RMSNorm", "SiLU(gate)", "rotary", "attention", "target"} <= names
    on = [p for p in probes if p["deterministic"]]
    assert on and all(p["differ"] == 0 and p["rows"] > 0 for p in on), \
        [p for p in on if p["differ"]]
    costs = run_bench("bench/numerics_bench.py", "costs", "--model", "tiny", "--quick",
                      "--repeats", "1", "--dtype", "bfloat16", "--out", str(out), timeout=900)
    assert {c["fix"] for c in json.loads(out.read_text())["costs"]} == {
        "off", "linears tiled", "attention per query", "on"}
    assert "Forward cost of each fix" in costs.stdout and "Row invariance" in r.stdout


@pytest.mark.slow  # ~40 s; CI has the mode's equality in tests/integration/test_invariant_bf16.py
def test_deterministic_bench_outputs_equal_the_target_only_batch_1_output(tmp_path):
    run_bench("bench/numerics_bench.py", "deterministic", "--pair", "tiny", "--modes", "on",
              "--scorings", "multi-query", "--streams", "1,2", "--classes", "code,copy",
              "--per-class", "1", "--max-tokens", "8", "--results", str(tmp_path),
              timeout=900)
    rows = json.loads((tmp_path / "deterministic_tiny_bfloat16.json").read_text())["rows"]
    assert [(r["path"], r["streams"]) for r in rows] == [
        ("target-only", 1), ("defaults", 1), ("defaults", 2), ("k=0", 2)]
    assert all(r["equal"] == 2 and r["tokens"] == 16 for r in rows), rows
