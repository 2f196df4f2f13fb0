"""Compiled forwards in a served scorer (`--compile on`, specdecode.executor.compile_mode), over
real processes on CPU: the scorer serves as soon as it is loaded and compiles its graphs in
the background, a forward taking a graph once it is ready; the greedy stream through the
orchestrator is the target's own before and after; a scorer restarted on the same
`--compile-cache` reloads every graph from it (none compiled anew) and serves compiled again.

`--max-num-seqs 1` keeps the graphs to batch bucket 1, decode and verify (2 graphs, ~10 s
each to compile on CI's 2 cores); fixed k=4 makes every verify 5 queries, a compiled shape.
No bound here is a speed: waits are for the metric the scorer exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdecode.api.client import SpecDecodeClient
from tests.support.cluster import Cluster
from tests.support.metrics import scrape_metrics
from tests.support.references import reference_greedy

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8]]
MAX_TOKENS = 16
GRAPHS = 2  # batch bucket 1 x (decode, verify at k = 4)
COMPILE_WAIT_S = 900  # compiling on a busy 2-core host (the wait ends once the metric says so)


def scorer_args(model_dir: str, cache: str) -> tuple[str, ...]:
    return ("--model", model_dir, "--device", "cpu", "--scoring", "multi-query",
            "--compile", "on", "--compile-cache", cache, "--max-num-seqs", "1")


def compiled_metrics(cluster: Cluster) -> dict[str, float]:
    """The scorer's compile metrics once its graphs are all ready."""
    deadline = time.monotonic() + COMPILE_WAIT_S
    while True:
        m = scrape_metrics(cluster.metrics_ports["scorer0"])
        if m['specdecode_model_compiled_graphs{role="scorer"}'] == GRAPHS:
            return m
        assert time.monotonic() < deadline, cluster.log_path("scorer0").read_text()[-3000:]
        time.sleep(0.5)


def greedy(cluster: Cluster, prompt: list[int]) -> list[int]:
    with SpecDecodeClient(cluster.address("orchestrator")) as client:
        return [t for r in client.stream(prompt, max_tokens=MAX_TOKENS) for t in r.token_ids]


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs, tmp_path_factory):
    cluster = Cluster(tiny_model_dirs, tmp_path_factory.mktemp("compiled"), k=4)
    cache = str(tmp_path_factory.mktemp("compile_cache"))
    cluster._spawn("scorer0", "scorer", *scorer_args(tiny_model_dirs["target"], cache))
    # Every proposal k long (no stop at an unsure draft token): every verify is 5 queries.
    cluster._spawn("proposer", "proposer", "--model", cluster.draft, "--device", "cpu",
                   "--draft-confidence", "0")
    cluster.wait_serving("scorer0")
    cluster.wait_serving("proposer")
    cluster.start_orchestrator()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_scorer_compiles_in_the_background_and_reloads_its_graphs_after_a_restart(
        cluster, target_model):
    want = [reference_greedy(target_model, p, MAX_TOKENS) for p in PROMPTS]
    log = cluster.log_path("scorer0")
    # Serving came first: the graphs compile after the scorer reported ready.
    text = log.read_text()
    assert "scorer ready" in text
    first = compiled_metrics(cluster)
    text = log.read_text()
    assert text.index("scorer ready") < text.index("compiled forwards ready")
    assert text.count("(compiled anew;") == GRAPHS
    assert first['specdecode_model_compile_cache_hits_total{role="scorer"}'] == 0
    assert [greedy(cluster, p) for p in PROMPTS] == want
    after = scrape_metrics(cluster.metrics_ports["scorer0"])
    assert after['specdecode_model_compiled_forwards_total{role="scorer"}'] > 0
    assert after['specdecode_model_recompiles_total{role="scorer"}'] == 0

    # The same scorer restarted on the same cache: every graph reloaded, none compiled anew.
    cluster.kill("scorer0")
    log.write_text("")
    cluster._spawn("scorer0", *cluster.spawned["scorer0"])
    cluster.wait_serving("scorer0")
    again = compiled_metrics(cluster)
    assert again['specdecode_model_compile_cache_hits_total{role="scorer"}'] == GRAPHS
    assert log.read_text().count("(reloaded from the compile cache;") == GRAPHS
    assert "compiled anew" not in log.read_text()
    assert [greedy(cluster, p) for p in PROMPTS] == want
    after = scrape_metrics(cluster.metrics_ports["scorer0"])
    assert after['specdecode_model_compiled_forwards_total{role="scorer"}'] > 0
    assert after['specdecode_model_recompiles_total{role="scorer"}'] == 0


# One process: a tiny model of `seed`, its decode at bucket 1 compiled through the cache in
# TORCHINDUCTOR_CACHE_DIR; prints the cache hits and whether its compiled logits equal eager.
COMPILE_ONE = """
import json, torch
from specdecode.executor.model_runner import ModelRunner, RunnerRow
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model
model = build_tiny_model(TinyModelSpec(seed=SEED))
cpu = torch.device("cpu")
eager = ModelRunner(model, cpu, enforce_eager=True)
compiled = ModelRunner(model, cpu, enforce_eager=False, compile_batch_sizes=(1,))
prompt = [5, 17, 99, 3, 8]
out = []
for runner in (eager, compiled):
    runner.forward([RunnerRow(1, prompt[:-1], 1)])
    out.append(runner.forward([RunnerRow(1, prompt, 1)])[0])
print(json.dumps({"hits": compiled.compiled.stats.cache_hits, "runs": compiled.compiled.stats.runs,
                  "equal": torch.allclose(out[0], out[1], atol=1e-4, rtol=1e-4)}))
"""


def compile_one(seed: int, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    r = subprocess.run([sys.executable, "-c", COMPILE_ONE.replace("SEED", str(seed))],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_graphs_reloaded_from_the_cache_run_the_weights_of_the_model_loaded_now(tmp_path):
    """The cache keys frozen weights by shape and dtype: a second model of the same shapes
    (another seed) reloads the first's graphs and must still compute with its own weights."""
    first = compile_one(1, tmp_path)
    second = compile_one(2, tmp_path)
    assert first["hits"] == 0 and first["equal"] and first["runs"] == 1
    assert second["hits"] == GRAPHS and second["runs"] == 1
    assert second["equal"]
