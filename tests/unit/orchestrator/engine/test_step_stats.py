"""Acceptance counted once: what a step's stats and a request's usage say, on a scripted
proposer and scorer whose outputs are fixed, so every count is known exactly."""

from __future__ import annotations

import torch

from orchestrator.engine.request import Request
from orchestrator.engine.core import SpecDecodeEngine
from orchestrator.engine.step_stats import StepStats
from orchestrator.engine.step_metrics import StepMetrics
from orchestrator.engine.spec_metrics import AsyncMetricsCollector
from specdecode.interfaces import (SpeculativeProposals, SpeculativeProposer, SpeculativeScorer,
                                   SpeculativeScores)
from specdecode.sequence import ExecuteModelRequest, SamplingParams

K = 3
DRAFT = [1, 2, 3]


class FixedProposer(SpeculativeProposer):
    """Proposes DRAFT for every sequence past its prompt step."""

    def get_proposals(self, req: ExecuteModelRequest) -> SpeculativeProposals:
        lens = [0 if sg.is_prompt else K for sg in req.seq_group_metadata_list]
        ids = torch.tensor([DRAFT if n else [-1] * K for n in lens])
        return SpeculativeProposals(ids, None, torch.tensor(lens))


class ScriptedScorer(SpeculativeScorer):
    """The target's tokens at positions 0..k, one script entry per call."""

    def __init__(self, script: list[list[int]]):
        self.script = iter(script)

    def score_proposals(self, req: ExecuteModelRequest,
                        proposals: SpeculativeProposals) -> SpeculativeScores:
        row = next(self.script)
        return SpeculativeScores(None, None, torch.tensor([row] * len(req.seq_group_metadata_list)))


def run(script: list[list[int]], max_tokens: int) -> tuple[list[StepStats], object]:
    engine = SpecDecodeEngine(FixedProposer(), ScriptedScorer(script), max_model_len=64,
                              num_speculative_tokens=K)
    engine.add_request(Request("r", [4, 4], SamplingParams(max_tokens=max_tokens)))
    steps, stats = [], None
    while engine.has_unfinished():
        (out,) = engine.step()
        steps.append(engine.last_step)
        stats = out.stats
    return steps, stats


def test_usage_accepted_never_exceeds_emitted():
    """Position 0 rejected, positions 1 and 2 pass the accept test: vLLM 0.4.2 counts 2
    accepted for the metrics, but the request received no draft token, so its usage says 0
    (it used to say 2 accepted with 1 emitted)."""
    steps, usage = run([[9, -1, -1, -1], [5, 2, 3, 7]], max_tokens=2)
    assert steps[1].accepted_tokens == 2 and steps[1].emitted_tokens == 1
    assert steps[1].accepted_by_position == [0, 0, 0]
    assert (usage.draft_tokens, usage.accepted_tokens, usage.emitted_tokens) == (3, 0, 1)
    assert usage.accepted_tokens <= usage.emitted_tokens


def test_one_step_stats_feed_prometheus_and_the_vllm_collector():
    steps, usage = run([[9, -1, -1, -1], [5, 2, 3, 7], [1, 2, 0, 7]], max_tokens=5)
    assert steps[2].accepted_tokens == 2 and steps[2].accepted_by_position == [1, 1, 0]
    assert (usage.draft_tokens, usage.accepted_tokens, usage.emitted_tokens) == (6, 2, 4)
    engine = SpecDecodeEngine(FixedProposer(), ScriptedScorer([]), max_model_len=64,
                              num_speculative_tokens=K)
    metrics = StepMetrics(engine, log_interval_s=0.0)
    for step in steps:
        metrics(step)
    totals = metrics.totals
    assert (totals.draft_tokens, totals.accepted_tokens, totals.emitted_tokens) == (6, 4, 4)
    assert totals.draft_acceptance_rate == 4 / 6
    assert totals.system_efficiency == 4 / (2 * (K + 1))
    collector = AsyncMetricsCollector(totals, collect_interval_s=0.0)  # vLLM 0.4.2's
    collector.init_tensors(rank=0)
    assert collector.maybe_collect_rejsample_metrics(K) is None  # takes the snapshot
    collected = collector.maybe_collect_rejsample_metrics(K)
    assert (collected.draft_tokens, collected.accepted_tokens, collected.emitted_tokens) == (6, 4, 4)
