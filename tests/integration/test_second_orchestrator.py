"""A second orchestrator against the same two services speculates as the first did (issue 31,
item 1): the proposer and the scorer pinned to disjoint cores (two one-core hosts) where the
machine has two, a lockstep orchestrator, then one with the defaults (adaptive k, drafting
ahead where it pays).

The first orchestrator's traffic leaves both services' forward-cost tables stale (it ran two
rows at once, a row count their grids lack), so once idle for 2 s they re-measure them, cell
by cell. The second orchestrator's first steps come during that re-measurement. Each of its
calls used to wait for the calibration cell being timed, and the policy, which learns what
drafting and verifying cost from its first speculative step, learned them up to 20x dearer
than they are and decoded plainly from then on. Now a call stops the cell at its next module
(specdecode.serving.model_access).

Real processes on 127.0.0.1. The pair is test_policy_recovery's kind: a target whose later
layers add nothing, drafted for by its first layer, so every proposal is accepted; its layers
are wide enough that forwards, not RPCs, make a step's time. It runs in bfloat16, where the
services' invariant numerics give the draft's rows the target's bits and a 5-token verify
costs about 1.3 decodes, so speculation pays about three times over on any host. (In
float32 a 3-5 token verify on one pinned thread cost 3-4 decodes: fully accepted speculation
gained 1.1-1.4x, and with two busy loops beside it the first exploration's predicted loss
still outgrew its budget on 1 run in 4 once the load was counted once.) What is asserted is
the policy's choice (it speculates through the request), not a speed."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time

import pytest

from specdecode.api.client import SpecDecodeClient
from specdecode_stack.local import (LocalStack, StackConfig, free_port, openmp_env,
                                    wait_process_serving)
from tests.support.metrics import scrape_metrics
from tests.support.models import save_self_drafting_pair

K = 4
PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 7, 8, 9]]
MAX_TOKENS = 32
# The services start re-measuring 2-3 s after the last call (idle 2 s, checked every second);
# the draft's re-measurement (24 cells of at least 50 ms, its widest ones 160 tokens) and the
# scorer's (15 cells of at least three of its forwards) last seconds beyond that.
IDLE_S = 3.5
PIN = {"proposer": "0", "scorer": "1"} if len(os.sched_getaffinity(0)) >= 2 else {}


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory) -> tuple[str, str]:
    """(target, draft) directories: an 8-layer target whose layers after the first add
    nothing (attention and MLP outputs zeroed), and its first layer as the draft."""
    return save_self_drafting_pair(tmp_path_factory.mktemp("models"), 8, 1024)


def generate(address: str, prompts: list[list[int]]):
    """The prompts at once, one request each: their results."""
    def one(prompt):
        with SpecDecodeClient(address) as client:
            return client.generate(prompt, max_tokens=MAX_TOKENS)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def start_orchestrator(stack: LocalStack, log) -> tuple[subprocess.Popen, str, int]:
    """Another orchestrator against the stack's services, with the defaults: (its process,
    address, metrics port)."""
    port, metrics = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specdecode_stack.cli", "serve", "orchestrator", "--host",
         "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics), "--http-port", "0",
         "--proposer", stack.service_addresses["proposer"],
         "--scorer", stack.service_addresses["scorer"], "--tokenizer", "none",
         "--num-speculative-tokens", str(K)],
        env={**os.environ, **openmp_env("orchestrator", os.environ)}, stdout=log,
        stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    wait_process_serving(address, 120, process)
    return process, address, metrics


def test_a_second_orchestrator_speculates_while_the_services_remeasure(wide_pair, tmp_path):
    config = StackConfig(target_model=wide_pair[0], draft_model=wide_pair[1], tokenizer="none",
                         device="cpu", dtype="bfloat16", port=0, num_speculative_tokens=K,
                         draft_confidence=0.0, async_drafting="off", pin=PIN,
                         log_file=str(tmp_path / "stack.log"))
    with LocalStack(config) as stack, open(tmp_path / "second.log", "w") as log:
        second, address, metrics = start_orchestrator(stack, log)
        try:
            # Lockstep, two requests at once: both services ran a row count their tables
            # lack, so they re-measure them once idle.
            assert all(r.usage.draft_tokens for r in generate(stack.address, PROMPTS[:2]))
            time.sleep(IDLE_S)
            (result,) = generate(address, PROMPTS[2:])
            scraped = scrape_metrics(metrics)
        finally:
            second.terminate()
            second.wait(60)
    usage = result.usage
    why = {k: v for k, v in scraped.items() if k.startswith("specdecode_chosen_k_count")}
    # Every proposal is accepted: it speculates through the request (its first step is the
    # prompt's, its last may be plain), not for one step and then never again.
    assert usage.draft_tokens >= MAX_TOKENS // 2, (usage, why)
    assert usage.accepted_tokens == usage.draft_tokens, usage
    if PIN:  # two hosts: the defaults draft ahead
        hits = scraped.get('specdecode_lookahead_sequences_total{outcome="hit"}', 0.0)
        assert hits > 0, scraped
