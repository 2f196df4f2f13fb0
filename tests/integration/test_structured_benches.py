"""The structured-output benches run in CI size (tiny models, byte tokenizer, seconds): a
change to what they call fails here, not on the next day of measurements."""

from __future__ import annotations

import json

from tests.support.benches import run_bench



def test_structured_bench_compares_speculation_and_the_defaults_with_k0_on_the_tiny_pair(tmp_path):
    out = tmp_path / "structured.json"
    run_bench("bench/structured_bench.py", "speculation", "--pair", "tiny", "--dtype", "float32", "--ks", "2",
              "--max-tokens", "24", "--repeats", "1", "--out", str(out))
    rows = {row["k"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {0, 2, "defaults", "defaults k=0"}
    assert rows[2]["acceptance"] is not None and rows[0]["acceptance"] is None
    assert rows["defaults k=0"]["acceptance"] is None
    for path in (2, "defaults", "defaults k=0"):  # float32: the same output on every path
        assert rows[path]["equal_tokens"] == rows[path]["reference_tokens"], path
    assert rows[0]["forced_share"] > 0 and rows[0]["us_per_mask"] > 0
    for row in rows.values():  # decode alone: each request's prompt steps left out
        assert 0 < row["settled_tokens_per_s"] and row["settled_speedup"] > 0
    assert rows[0]["settled_speedup"] == 1.0


def test_grammar_engines_bench_measures_the_chosen_engine(tmp_path):
    out = tmp_path / "engines.json"
    r = run_bench("bench/structured_bench.py", "engines", "--tokenizers", "smollm2", "--engines",
                  "llguidance",
                  "--repeats", "1", "--out", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["engine"] == "llguidance" and row["mask_us_median"] > 0
    assert "llguidance" in r.stdout
