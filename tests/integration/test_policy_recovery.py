"""A stack started while busy loops hold every core, then left alone, speculates as one
started on the idle machine does (issue 20): its services re-measure their start-up tables
while idle (specdecode.serving.recalibration), the orchestrator adopts them (cost_refresh), and its
chosen k matches the idle-started stack's within 60 s of the load ending.

Three real processes per stack: a tiny random target without attention (its next token
depends on the last one only) whose last layers are
identities, drafted for by its first layer alone: the draft computes the target's own
function at a 32nd of its forward, every proposal is accepted, and speculation pays
several times over on any host, so both stacks settle on the maximum k. Started under load
both start-up tables come out many times too dear; the draft's is the one plain decoding
never corrects (the issue's lock-in: k = 0 for good). What is asserted is the policy's
behaviour (which k), not a speed: other work on the machine changes the times, not the
decisions.

The same pair runs the proposer-kill drill (issue 36): the proposer killed with SIGKILL
mid-stream and restarted on its port, a short request after it speculates again."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from orchestrator.cluster.cost_refresh import REFRESH_S
from orchestrator.cluster.remote import RemoteProposer, RemoteScorer
from orchestrator.engine.speculation_policy import REASONS
from specdecode.api.client import SpecDecodeClient
from specdecode_stack.local import LocalStack, StackConfig, wait_process_serving
from tests.support.metrics import scrape_metrics
from tests.support.models import save_self_drafting_pair

K = 4
PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 7, 8, 9]]
MAX_TOKENS = 32
CHOSEN_K_BUCKETS = (0, 1, 2, 3, 4)
WITHIN_S = 60.0
# Wide enough that a target forward is compute (~25 ms on 2 idle cores), not per-call
# overhead: with the default 64 a loaded host made the draft's four sequential calls (90 ms,
# each waiting for a time slice) dearer than the target's decode (20 ms), and plain decoding
# was then truly faster -- the idle-started stack's k = 0 was right, and the test's premise
# (speculation pays several times over on any host) false.
HIDDEN = 512


def chosen_k(port: int) -> tuple[Counter, Counter]:
    """How many sequence-steps chose each k, and each reason (the orchestrator's
    specdecode_chosen_k buckets, labelled by reason)."""
    buckets = {}  # (reason, le) -> cumulative count
    for key, value in scrape_metrics(port).items():
        if key.startswith("specdecode_chosen_k_bucket{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
            buckets[labels["reason"], labels["le"]] = value
    ks, why = Counter(), Counter()
    for reason in REASONS:
        cumulative = [buckets.get((reason, str(float(k))), 0.0) for k in CHOSEN_K_BUCKETS]
        for i, (k, c) in enumerate(zip(CHOSEN_K_BUCKETS, cumulative)):
            ks[k] += c - (cumulative[i - 1] if i else 0.0)
        why[reason] = buckets.get((reason, "+Inf"), 0.0)
    return ks, why

def decode_steps(stack: LocalStack) -> tuple[Counter, Counter]:
    """Run the prompts one after the other, twice: the chosen k of the second pass's decode
    steps (the prompt steps, k = 0 by construction, left out), and the reasons of all its
    steps. The first pass settles the policy: beside other work a stack's first speculative
    steps run slower than its later ones (two busy loops beside this pair at fixed k = 4:
    10.3, 16.0, 14.5 tok/s over three passes; plain decoding 8.0, 9.0), and the policy
    rightly decodes plainly while they do ("unrealized"), so the first pass's histogram
    says how noisy the host was, not which k the policy settles on."""
    port = stack.metrics_ports["orchestrator"]
    with SpecDecodeClient(stack.address) as client:
        def run_prompts() -> None:
            for p in PROMPTS:
                assert len(client.generate(p, max_tokens=MAX_TOKENS).token_ids) == MAX_TOKENS
        run_prompts()
        ks, why = chosen_k(port)
        run_prompts()
    ks_after, why_after = chosen_k(port)
    counts = ks_after - ks
    counts[0] -= len(PROMPTS)
    return +counts, +(why_after - why)


def forward_cost(stack: LocalStack, role: str):
    """The service's forward-cost table now (role: scorer | proposer)."""
    client = RemoteScorer if role == "scorer" else RemoteProposer
    with grpc.insecure_channel(stack.service_addresses[role]) as channel:
        return client(channel).model_info().forward_cost


def tables(stack: LocalStack) -> dict[str, list[list[float]]]:
    """Both services' forward-cost tables now, in milliseconds (for a failure's message)."""
    return {role: [[round(1e3 * s, 1) for s in line] for line in forward_cost(stack, role).seconds]
            for role in ("scorer", "proposer")}


def wait_for_log(path: Path, text: str, timeout_s: float, after: int = 0) -> bool:
    """Whether `text` appears in the log (past its first `after` characters) in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text()[after:]:
            return True
        time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def cycling_pair(tmp_path_factory) -> tuple[str, str]:
    """(target, draft) directories: the target's layers after the first add nothing (their
    attention and MLP outputs are zeroed); the draft is its first layer."""
    return save_self_drafting_pair(tmp_path_factory.mktemp("models"), 32, HIDDEN)


def test_a_stack_started_under_load_chooses_what_an_idle_started_one_does(cycling_pair,
                                                                          tmp_path):
    def config(log: Path) -> StackConfig:
        log.write_text("")
        return StackConfig(target_model=cycling_pair[0], draft_model=cycling_pair[1],
                           tokenizer="none", device="cpu", port=0, num_speculative_tokens=K,
                           draft_confidence=0.0, log_file=str(log))

    with LocalStack(config(tmp_path / "idle.log")) as idle:
        idle_k, idle_why = decode_steps(idle)
        idle_tables = tables(idle)
    # Every proposal is accepted: the idle-started stack speculates deeply (K, or a step
    # less when other work on the machine makes its times noisy).
    idle_mode = idle_k.most_common(1)[0][0]
    assert idle_mode >= K - 1, (idle_k, idle_why, idle_tables)

    busy_log = tmp_path / "busy.log"
    stack = LocalStack(config(busy_log))
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(os.cpu_count() or 2)]
    ended = []

    def end_load_once_the_scorer_serves() -> None:  # its start-up table was taken under load
        wait_process_serving(stack.service_addresses["scorer"], 600)
        for loop in loops:
            loop.kill()
            loop.wait()
        ended.append(time.monotonic())
    ender = threading.Thread(target=end_load_once_the_scorer_serves, daemon=True)
    ender.start()
    try:  # one stack, started under load (`with stack` would start a second, idle one)
        try:
            stack.start()
        finally:
            ender.join(600)
            for loop in loops:
                loop.kill()
        # Left alone: the scorer probes while idle, re-measures, the orchestrator adopts.
        version = forward_cost(stack, "scorer").version
        adopted = wait_for_log(busy_log, "adopting the scorer's re-measured forward costs",
                               ended[0] + WITHIN_S - REFRESH_S - time.monotonic())
        busy_k, busy_why = decode_steps(stack)
        remeasured = forward_cost(stack, "scorer").version
        busy_tables = tables(stack)
    finally:
        stack.stop()
    # The busy start did not lock speculation out (the k = 0 for good): it chooses
    # the idle-started stack's k, within the one step that noisy times can move it.
    assert abs(busy_k.most_common(1)[0][0] - idle_mode) <= 1 and busy_k[0] < busy_k.total() / 2, (
        f"chosen k {dict(busy_k)} after a start under load (table version {version} at start, "
        f"{remeasured} after; adopted: {adopted}; reasons {dict(busy_why)}; tables, ms: "
        f"{busy_tables}) vs {dict(idle_k)} started idle (tables, ms: {idle_tables})")


def test_after_a_proposer_restart_a_short_request_speculates_again(cycling_pair, tmp_path):
    """The proposer-kill drill (issue 36): 4 streams, the proposer killed with SIGKILL
    mid-stream (the streams complete without it), restarted on its port; a 24-token request
    10 s after the orchestrator has the replica up again drafts. The proposer had
    re-measured its table before (version 1, adopted); the restarted process reports its
    start-up table (version 0) again, which the orchestrator took for a re-measurement and
    adopted: the policy forgot what its steps had learned, with no sequence running to
    check the tables again, and a short request then speculated only where that start-up
    table alone promised a 1.5x gain (never for SmolLM2 drafting for itself, nor with a
    table taken while the scorer was busy). Whether this pair's start-up table promises
    it depends on the host, so the adoption itself is asserted too."""
    log = tmp_path / "stack.log"
    log.write_text("")
    stack = LocalStack(StackConfig(
        target_model=cycling_pair[0], draft_model=cycling_pair[1], tokenizer="none",
        device="cpu", port=0, num_speculative_tokens=K, draft_confidence=0.0,
        log_file=str(log), log_format="text", log_level="info"))

    def streams(lengths: list[int], kill: bool = False) -> list[int]:
        """One stream per length at once (they end apart: batches of 4, 3, 2, 1 rows);
        with `kill`, the proposer is killed once every stream has its first tokens."""
        started = threading.Barrier(len(lengths) + 1)

        def run(i: int) -> int:
            tokens = 0
            with SpecDecodeClient(stack.address) as client:
                for response in client.stream(PROMPTS[i % len(PROMPTS)], max_tokens=lengths[i]):
                    if not tokens:
                        started.wait(60)
                    tokens += len(response.token_ids)
            return tokens
        with concurrent.futures.ThreadPoolExecutor(len(lengths)) as pool:
            futures = [pool.submit(run, i) for i in range(len(lengths))]
            started.wait(60)
            if kill:
                stack.processes["proposer"].kill()
                stack.processes["proposer"].wait()
            return [f.result(timeout=300) for f in futures]

    def drafted() -> int:
        with SpecDecodeClient(stack.address) as client:
            return client.generate(PROMPTS[1], max_tokens=24).usage.draft_tokens

    try:
        stack.start()
        # Row counts the start-up grid (1 and 4 rows) lacks: the proposer re-measures its
        # table once idle (version 1), and the orchestrator adopts it.
        lengths = [24, 48, 72, 96]
        assert streams(lengths) == lengths
        assert wait_for_log(log, "adopting the proposer's re-measured forward costs", 60), \
            "the proposer's table was not re-measured after traffic of 2 and 3 rows"
        before = drafted()
        assert before > 0, "the cycling pair did not speculate before the drill"

        assert streams([120] * 4, kill=True) == [120] * 4
        restarted = len(log.read_text())
        stack.restart("proposer")  # same port and arguments, no state
        assert wait_for_log(log, "up (reports SERVING)", 30, after=restarted)
        time.sleep(2 * REFRESH_S)  # the orchestrator has asked it for its table by now
        after = drafted()
        tail = log.read_text()[restarted:]
    finally:
        stack.stop()
    adopted = re.findall(r"adopting the proposer's re-measured forward costs .*", tail)
    assert after > 0, (f"no draft token 10 s after the proposer's restart ({before} before); "
                       f"adopted since the restart: {adopted}")
    assert not [line for line in adopted if line.endswith("version 0)")], adopted
