"""Drafting ahead over real processes (orchestrator.engine.lookahead, `--async-drafting`):
greedy output equal to the target's through hits and misses, with sequence deltas and no
full resend; a seeded sampled request the same with it on and off; `auto` drafts nothing
ahead where proposer and scorer share cores; and issue 10's drill (the proposer killed
mid-stream) with lookaheads in flight."""

from __future__ import annotations

import concurrent.futures

import pytest

from specdecode.api.client import SpecDecodeClient
from tests.integration.test_faults import PROMPTS, PROPOSER_TIMEOUT_S, reference  # noqa: F401 (fixture)
from tests.integration.test_faults import test_proposer_kill_falls_back_and_resumes as proposer_kill_drill
from tests.support.cluster import Cluster
from tests.unit.orchestrator.engine.test_lookahead import near_copy

SAMPLED = dict(temperature=0.8, top_k=8)


@pytest.fixture(scope="module")
def ahead(tiny_model_dirs, target_model, tmp_path_factory):
    """Scorer, proposer (a draft that often agrees with the target) and an orchestrator
    drafting ahead at a fixed k = 2."""
    near = tmp_path_factory.mktemp("near") / "draft"
    near_copy(target_model, 0.05).save_pretrained(near)
    cluster = Cluster({**tiny_model_dirs, "near": str(near)}, tmp_path_factory.mktemp("ahead"),
                      draft="near", k=2, orchestrator_args=(
                          "--async-drafting", "on", "--proposer-timeout",
                          str(PROPOSER_TIMEOUT_S), "--grace-seconds", "0.5"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def lookahead(cluster: Cluster, name: str = "orchestrator") -> tuple[float, float]:
    """(hits, misses) the orchestrator counted so far."""
    return tuple(cluster.metric(name, "specdecode_lookahead_sequences_total",
                                f'outcome="{o}"') for o in ("hit", "miss"))


def generate(address: str, prompts: list[list[int]], max_tokens: int, **params):
    def one(i):
        with SpecDecodeClient(address) as client:
            return client.generate(prompts[i], max_tokens=max_tokens, **params).token_ids
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def test_greedy_output_is_the_targets_through_hits_and_misses(ahead, reference):
    (hits0, misses0), n = lookahead(ahead), 64
    resends0 = ahead.metric("orchestrator", "specdecode_full_resends_total", 'role="proposer"')
    outs = generate(ahead.address("orchestrator"), PROMPTS[:6], n)
    for i, tokens in enumerate(outs):
        assert tokens == reference(i)[:n], i
    hits, misses = lookahead(ahead)
    assert hits - hits0 >= 10 and misses - misses0 >= 10, (hits - hits0, misses - misses0)
    # A miss rolls the proposer's record back within the delta: nothing is resent in full.
    assert ahead.metric("orchestrator", "specdecode_full_resends_total",
                        'role="proposer"') == resends0


def test_seeded_sampled_output_is_the_same_with_lookahead_on_and_off(ahead):
    ahead.start_orchestrator("orchestrator2", "--async-drafting", "off")
    try:
        hits0, _ = lookahead(ahead)
        on = generate(ahead.address("orchestrator"), PROMPTS[:4], 48, seed=7, **SAMPLED)
        off = generate(ahead.address("orchestrator2"), PROMPTS[:4], 48, seed=7, **SAMPLED)
        assert lookahead(ahead)[0] > hits0
        assert lookahead(ahead, "orchestrator2") == (0, 0)
    finally:
        ahead.kill("orchestrator2")
    assert on == off


def test_auto_drafts_nothing_ahead_where_the_services_share_cores(ahead, reference):
    ahead.start_orchestrator("orchestrator3", "--async-drafting", "auto")
    try:
        outs = generate(ahead.address("orchestrator3"), PROMPTS[:2], 32)
        assert lookahead(ahead, "orchestrator3") == (0, 0)
    finally:
        ahead.kill("orchestrator3")
    assert outs == [reference(i)[:32] for i in range(2)]


def test_proposer_killed_with_lookaheads_in_flight(ahead, reference):
    """Issue 10's drill with --async-drafting on (every step of its streams drafts ahead,
    so the kill finds a lookahead in flight): the streams complete, identical, and the
    lookaheads the dead proposer held are dropped as misses."""
    _, misses0 = lookahead(ahead)
    proposer_kill_drill(ahead, reference)
    assert lookahead(ahead)[1] > misses0
