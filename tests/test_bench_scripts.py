"""Bench scripts that reach into the engine's internals still run (tiny models, seconds): a
refactor that changes what they call fails here, not on the next day of measurements (the
policy tracer broke once, unseen, when the policy's exploration gained a parameter)."""

from __future__ import annotations

import json
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


def test_adaptive_bench_compares_the_stack_with_the_greedy_output_up_to_its_end_token(tmp_path):
    """The tiny pair's target ends its Q&A answer within 4 tokens (an end token in its
    generation config, as the real pair's `<|im_end|>`). HF target-only is held past it by
    min_new_tokens, the stack (no tokenizer, so no end rule) decodes on greedily: compared
    over all 8 tokens they differ at the end token (the old table's "3/8" on every stack
    path); up to and including it they are equal, and the stack's paths equal each other
    over all 8."""
    r = subprocess.run(
        [sys.executable, "bench/adaptive_bench.py", "--pair", "tiny", "--quick", "--max-tokens",
         "8", "--parts", "ref,defaults", "--classes", "qa", "--dtypes", "float32",
         "--results", str(tmp_path)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "adaptive_tiny_float32_native.json").read_text())
    end = result["greedy_ends"]["qa"]
    assert 1 <= end <= 4
    rows = {row["path"]: row for row in result["rows"]}
    assert rows["HF target-only"]["equal"] == "8/8"  # HF paths: its whole (forced) output
    for path in ("stack k=0", "stack defaults"):
        assert rows[path]["equal"] == f"{end}/{end} to EOS", rows[path]
        assert rows[path]["reference"] == "greedy to EOS"
    assert rows["stack defaults"]["equal_own_k0"] == "8/8"
    assert "first differs" not in r.stdout  # no output left its reference
