"""Bench scripts that reach into the engine's internals still run (tiny models, seconds): a
refactor that changes what they call fails here, not on the next day of measurements (the
policy tracer broke once, unseen, when the policy's exploration gained a parameter)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support.paths import ROOT


@pytest.mark.slow  # ~25 s; the plans it prints are the policy's, tested in tests/unit
def test_policy_trace_prints_every_steps_plan_and_the_cost_tables(tmp_path):
    r = subprocess.run(
        [sys.executable, "bench/policy_bench.py", "trace", "--pair", "tiny", "--max-tokens", "16",
         "--dtype", "float32", "--out", str(tmp_path / "trace.json")], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = re.findall(r"^\s*\d+ k=\[\d+\] .*\| draft x[\d.]+ catch-up x", r.stdout, re.M)
    assert len(steps) >= 4  # 16 tokens: a prompt step, then at least 3 more
    assert re.search(r"^== code: 16 tokens in [\d.]+ s", r.stdout, re.M)
    for table in ("scorer at start-up", "draft at start-up", "scorer at the end",
                  "proposer at the end"):
        assert table in r.stdout


def run_adaptive(tmp_path, *args: str,
                 timeout: int = 300) -> tuple[subprocess.CompletedProcess, dict]:
    """adaptive_bench on the tiny pair in fp32, its results under tmp_path: (the run, its
    JSON)."""
    r = subprocess.run(
        [sys.executable, "bench/adaptive_bench.py", "--pair", "tiny", "--quick", "--dtypes",
         "float32", "--results", str(tmp_path), *args], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads((tmp_path / "adaptive_tiny_float32_native.json").read_text())


def test_adaptive_bench_compares_the_stack_with_the_greedy_output_up_to_its_end_token(tmp_path):
    """The tiny pair's target ends its Q&A answer within 4 tokens (an end token in its
    generation config, as the real pair's `<|im_end|>`). HF target-only is held past it by
    min_new_tokens, the stack (no tokenizer, so no end rule) decodes on greedily: compared
    over all 8 tokens they differ at the end token (the old table's "3/8" on every stack
    path); up to and including it they are equal, and the stack's paths equal each other
    over all 8."""
    r, result = run_adaptive(tmp_path, "--max-tokens", "8", "--parts", "ref,defaults",
                             "--classes", "qa")
    end = result["greedy_ends"]["qa"]
    assert 1 <= end <= 4
    rows = {row["path"]: row for row in result["rows"]}
    assert rows["HF target-only"]["equal"] == "8/8"  # HF paths: its whole (forced) output
    for path in ("stack k=0", "stack defaults"):
        assert rows[path]["equal"] == f"{end}/{end} to EOS", rows[path]
        assert rows[path]["reference"] == "greedy to EOS"
    assert rows["stack defaults"]["equal_own_k0"] == "8/8"
    # the policy's predicted speed-up beside the measured one (issue 36), scraped per run
    assert rows["stack defaults"]["predicted_speedup"] > 0
    assert rows["stack k=0"]["predicted_speedup"] is None
    assert "first differs" not in r.stdout  # no output left its reference


def test_adaptive_bench_streams_send_their_rounds_one_after_the_other(tmp_path):
    """--stream-rounds 2: each of the two streams sends its prompt twice, one request after
    the other (a steady load, not a batch timed to its last request): each stream's row sums
    both requests' tokens, and its output (greedy, the same each round) equals the target's."""
    _, result = run_adaptive(tmp_path, "--max-tokens", "6", "--parts", "ref,streams",
                             "--classes", "code,qa", "--stream-rounds", "2")
    runs = [json.loads(line) for line in
            (tmp_path / "adaptive_tiny_float32_native.jsonl").read_text().splitlines()]
    streams = [row for row in runs if row["streams"] == 2 and row["class"] != "all"]
    assert {row["path"] for row in streams} == {"stack defaults", "stack k=0"}
    assert all(row["tokens"] == 2 * 6 for row in streams), streams
    totals = [row for row in runs if row["class"] == "all"]
    assert all(row["tokens"] == 2 * 2 * 6 for row in totals), totals
    rows = [row for row in result["rows"] if row["streams"] == 2]  # both prompts' outputs
    assert len(rows) == 2 and all(row["compared_tokens"] > 0 for row in rows), rows
    assert all(row["equal_tokens"] == row["compared_tokens"] for row in rows), rows


@pytest.mark.slow  # ~55 s; CI has the busy start in tests/integration/test_policy_recovery.py
def test_adaptive_bench_runs_a_stack_started_under_load(tmp_path):
    """--parts busy: a stack started while busy loops held every core generates (its row
    beside HF target-only's greedy output, equal to it)."""
    _, result = run_adaptive(tmp_path, "--max-tokens", "4", "--parts", "ref,busy",
                             "--busy-wait", "0", "--classes", "code", timeout=540)
    rows = {row["path"]: row for row in result["rows"]}
    assert rows["stack defaults, started under load, 0 s after"]["equal"] == "4/4"


def run_ceiling(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run(
        [sys.executable, "bench/policy_bench.py", "ceiling", "--pair", "tiny", "--dtype", "float32",
         "--classes", "copy", "--widths", "1-3", "--repeats", "1", "--vocab", "128",
         "--max-tokens", "6", "--tokens", "6,12", "--alphas", "1.0,0.9", "--results", str(tmp_path),
         *args], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads((tmp_path / "ceiling_float32_native.json").read_text())


def test_ceiling_prices_every_k_from_measured_forwards(tmp_path):
    """The stacks' cost per step from an earlier run (here: 5 ms plain, 8 ms speculating);
    forwards and HF measured on the tiny pair."""
    earlier = tmp_path / "earlier.json"
    step = lambda o: {"overhead_s": o, "class": "copy"}  # noqa: E731
    earlier.write_text(json.dumps({"stack_overheads": {"ngram": {"0": step(0.005), "2": step(0.008)},
                                                       "draft": {"0": step(0.005), "2": step(0.008)}}}))
    r, result = run_ceiling(tmp_path, "--hf", "--hf-k", "2", "--overheads-from", str(earlier))
    assert set(result["verify_s"]) == {"1", "2", "3"}
    assert result["hf_best"]["copy"]["config"] in ("assisted defaults", "assisted k=2")
    ceilings = {(c["path"], c["alpha"]): c for c in result["ceilings"] if c["class"] == "copy"}
    for path in ("stack, n-gram", "in-process, n-gram", "stack, 0.5B draft",
                 "in-process, 0.5B draft", "stack, a free draft step"):
        assert (path, 1.0) in ceilings and (path, 0.9) in ceilings
    ngram = ceilings[("stack, n-gram", 1.0)]
    assert 0 <= ngram["at_n"]["k"] <= 2 and set(ngram["by_n"]) == {"6", "12"}
    # The hop only costs: the stack's ceiling is below the same forwards in-process.
    assert ngram["steady"]["tokens_per_s"] < ceilings[("in-process, n-gram", 1.0)]["steady"]["tokens_per_s"]
    assert "stack, n-gram, copy, acceptance 1.0: vs its own k=0" in r.stdout
    assert "HF assisted best measured, copy" in r.stdout


@pytest.mark.slow  # a local stack's three processes (~15 s on 2 cores): CI keeps the above
def test_ceiling_measures_the_stacks_own_cost_per_step(tmp_path):
    r, result = run_ceiling(tmp_path, "--stack", "ngram", "--stack-k", "0,2")
    steps = result["stack_overheads"]["ngram"]
    assert set(steps) == {"0", "2"}
    assert all(s["steps"] >= 6 and 0 < s["overhead_s"] < 1 for s in steps.values())
    assert "priced by the model" in r.stdout
