"""The compiled forwards (CompiledForwards) on CPU, as CI can run them: a tiny model's decode
and verify compiled with fullgraph=True (a graph break fails the runner's construction) at
batch bucket 4 (every bucket under -m slow: compiling costs ~25 s a graph on CI's 2 cores),
compiled against eager logits and greedy tokens, padding rows, no recompilation across row
lengths, speculative decoding through the compiled target and draft equal to target-only
greedy decoding, and bench/device_bench.py check on CPU. One inductor cache for the module: the
later runners' graphs of the same shapes reuse the first's kernels."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdecode.executor.model_runner import ModelRunner, RunnerRow
from specdecode_stack.inprocess import build_inprocess_engine
from tests.support.models import CPU, greedy_request
from tests.support.references import reference_greedy

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 43], [7, 8, 9, 7, 8, 9]]


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


@pytest.fixture(scope="module")
def runners(target_model):
    eager = ModelRunner(target_model, CPU, enforce_eager=True)
    compiled = ModelRunner(target_model, CPU, enforce_eager=False, compile_batch_sizes=(4,))
    assert compiled.compiled is not None and compiled.compiled.stats.graphs == 2
    return eager, compiled


@pytest.mark.slow
def test_every_bucket_compiles_without_a_graph_break(target_model):
    runner = ModelRunner(target_model, CPU, enforce_eager=False)
    assert runner.compiled.stats.graphs == 12  # 6 batch buckets x decode and verify


def step(runner, prompts, q, offset):
    """Prefill the prompts, then one forward of q new tokens per row: its logits, and how
    many compiled graphs that forward ran (0 eager)."""
    runner.forward([RunnerRow(i, p, 1) for i, p in enumerate(prompts)])
    runs = runner.compiled.stats.runs if runner.compiled else 0
    logits = runner.forward([RunnerRow(i, p + [(offset + j) % 256 for j in range(q)], q)
                             for i, p in enumerate(prompts)])
    return logits, (runner.compiled.stats.runs if runner.compiled else 0) - runs


@pytest.mark.parametrize("B", [1, 3, 4])  # 1 and 3: padded to the bucket
@pytest.mark.parametrize("q", [1, 5])
def test_compiled_decode_and_verify_logits_equal_eager(runners, B, q):
    eager, compiled = runners
    want, _ = step(eager, PROMPTS[:B], q, 3 * B + q)
    got, graphs = step(compiled, PROMPTS[:B], q, 3 * B + q)
    assert graphs == 1
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_compiled_greedy_decoding_equals_eager_across_lengths_without_recompiling(runners):
    """24 decode steps grow every row past several key windows: one graph serves them all."""
    eager, compiled = runners
    out = {}
    for name, runner in (("eager", eager), ("compiled", compiled)):
        seqs = [list(p) for p in PROMPTS[:3]]
        for _ in range(24):
            logits = runner.forward([RunnerRow(10 + i, s, 1) for i, s in enumerate(seqs)])
            for s, row in zip(seqs, logits):
                s.append(int(row[-1].argmax()))
        out[name] = seqs
    assert out["compiled"] == out["eager"]
    assert compiled.compiled.stats.recompiles == 0


def test_speculative_decoding_through_compiled_forwards_equals_target_only(target_model,
                                                                          draft_model):
    engine = build_inprocess_engine(target_model, draft_model, "multi-query", 4, CPU,
                                    enforce_eager=False, compile_batch_sizes=(4,))
    target = engine.scorer.worker.runner.compiled
    done = engine.generate([greedy_request(str(i), p, 16) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert done[str(i)].output_token_ids == reference_greedy(target_model, p, 16)
    assert target.stats.runs > 0 and target.stats.recompiles == 0


def run_bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_device_check_on_cpu_goes_through_the_compiled_forwards(tmp_path):
    """The device check a lent GPU runs, at CI size: draft speculation with multi-query
    scoring, compiled (its forwards counted) and eager, both equal to the reference."""
    r = run_bench("bench/device_bench.py", "check", "--device", "cpu", "--buckets", "4",
                  "--configs", "draft:multi-query:4", "--max-tokens", "8", "--out",
                  str(tmp_path / "device_check.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    compiled = re.search(r"draft\s*│\s*multi-query\s*│\s*4\s*│\s*compiled\s*│\s*(\d+)\s*│\s*yes",
                         r.stdout)
    assert compiled and int(compiled.group(1)) > 0, r.stdout
    assert re.search(r"│\s*eager\s*│\s*0\s*│\s*yes", r.stdout), r.stdout


@pytest.mark.slow
def test_gpu_bench_runs_compiled_on_cpu_at_small_shapes(tmp_path):
    out = tmp_path / "gpu_bench.json"
    r = run_bench("bench/device_bench.py", "gpu", "--small", "--device", "cpu", "--dtype",
                  "float32", "--batches", "1", "--max-tokens", "8", "--prompt-len", "16", "--buckets", "1",
                  "--out", str(out), timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(out.read_text())["rows"][0]["what"] == "target-only"
