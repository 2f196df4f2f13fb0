"""Drafting ahead in-process (orchestrator.engine.lookahead): a chain is used only where the
sequence's real prefix is its own, the output stays the target's (greedy: token for token,
hits and misses both taken; sampled: in distribution), and a seeded request gives the same
tokens with lookahead on and off."""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch

from orchestrator.engine.lookahead import Lookahead
from orchestrator.engine.request import Request, Sequence
from specdecode.interfaces import SpeculativeProposals
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)
from specdecode.sampling import truncated_probs
from specdecode_stack.inprocess import build_inprocess_engine
from tests.support.chi_square import chi_square_pvalue
from tests.support.models import greedy_request, self_drafting_pair
from tests.support.references import reference_greedy

PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8], [42, 42], [200, 100, 50, 25]]
PARAMS = dict(temperature=1.0, top_k=6, top_p=0.95)


def near_copy(model, sigma: float, seed: int = 0):
    """The model with noise on its LM head: a draft that agrees with it often, not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        draft.lm_head.weight += sigma * torch.randn(draft.lm_head.weight.shape, generator=g)
    return draft


class ChainProposer:
    """Proposes, for each row, the next tokens of a fixed chain (the row's tokens continue it)."""

    def __init__(self, chain: list[int]):
        self.chain, self.calls = chain, []

    def __call__(self, req: ExecuteModelRequest) -> SpeculativeProposals:
        self.calls.append(req)
        rows = []
        for sg in req.seq_group_metadata_list:
            n = sg.data.get_len()
            rows.append(self.chain[n:n + sg.num_speculative_tokens])
        k = req.num_lookahead_slots
        ids = torch.tensor([r + [-1] * (k - len(r)) for r in rows])
        return SpeculativeProposals(ids, None, torch.tensor([len(r) for r in rows]))


def sequence(seq_id: int, tokens: list[int]) -> tuple[Sequence, SequenceGroupMetadata]:
    seq = Sequence(seq_id, Request(str(seq_id), tokens[:2], SamplingParams(max_tokens=64)),
                   output_token_ids=list(tokens[2:]))
    sg = SequenceGroupMetadata(str(seq_id), False, {seq_id: SequenceData(tokens[:2],
                                                                         tokens[2:])},
                               SamplingParams(max_tokens=64), num_speculative_tokens=2)
    return seq, sg


@pytest.mark.parametrize("emitted, ready", [
    ([12, 13, 14], [15, 16]),  # every proposal accepted, the guess of the bonus right: a hit
    ([12, 13, 99], None),  # all accepted, another bonus token: the chain was drafted from 14
    ([12, 77], None),  # a rejection: nothing drafted after it is used
    ([12, 13], None),  # accepted, but the stop rules cut the bonus (finished: dropped)
])
def test_a_chain_is_kept_only_where_the_real_prefix_is_its_own(emitted, ready):
    chain = list(range(10, 30))  # the draft's own continuation: 10 11 12 13 14 15 16 ...
    proposer = ChainProposer(chain)
    ahead = Lookahead(proposer)
    seq, sg = sequence(1, chain[:2])
    ahead.launch([(seq, sg, [12, 13], 2)])  # this step proposed 12 13; next k = 2
    seq.output_token_ids += emitted
    if len(emitted) == 2:
        seq.finish_reason = "length"
    ahead.settle()
    guess, rest = proposer.calls  # the guess of the target's token, then the next proposal
    assert guess.seq_group_metadata_list[0].data.output_token_ids == [12, 13]  # assumed
    assert guess.num_lookahead_slots == 1 and guess.draft_ahead
    assert rest.seq_group_metadata_list[0].data.output_token_ids == [12, 13, 14]
    assert rest.seq_group_metadata_list[0].num_speculative_tokens == 2
    got = ahead.take(1, 2, len(seq.token_ids))
    assert (got and got.tokens) == ready
    stats = ahead.take_stats()
    assert (stats.hits, stats.misses, stats.drafted) == ((1, 0, 3) if ready else (0, 1, 3))


def test_a_proposal_drafted_ahead_is_dropped_after_a_plain_step():
    """A hit's proposal is for the step right after it. The policy may decode that step
    plainly (it then takes no proposal); the sequence is a token longer at the next
    speculative step, where the kept proposal would follow a stale prefix and be rejected
    (a draft identical to its target accepted 18 of 20 beside two busy loops)."""
    chain = list(range(10, 30))
    proposer = ChainProposer(chain)
    ahead = Lookahead(proposer)
    seq, sg = sequence(1, chain[:2])
    ahead.launch([(seq, sg, [12, 13], 2)])
    seq.output_token_ids += [12, 13, 14]  # a hit: 15 16 are ready for 5 tokens
    ahead.settle()
    seq.output_token_ids += [15]  # a plain step
    _, later = sequence(1, seq.token_ids)
    proposals = ahead.proposals(ExecuteModelRequest([later], num_lookahead_slots=2), proposer)
    assert proposals.proposal_token_ids.tolist() == [[16, 17]] and proposals.ahead == 0
    assert ahead.take_stats().wasted == 2


def test_a_miss_everywhere_cancels_the_call_and_a_release_waits_for_it():
    gate = []

    def slow(req):
        from orchestrator.engine import deadlines
        cancel = deadlines.current_cancel()
        gate.append(cancel)
        while not cancel.is_set:  # a remote client returns when cancelled
            pass
        raise deadlines.CallCancelled("cancelled")

    ahead = Lookahead(slow)
    seq, sg = sequence(2, [10, 11])
    ahead.launch([(seq, sg, [12], 1)])
    seq.output_token_ids += [77]  # rejected at once: no row may hit
    ahead.settle()  # cancels; returns
    assert gate[0].is_set and ahead.take_stats().misses == 1
    ahead.launch([(seq, sg, [12], 1)])
    seq.finish_reason = "cancelled"
    ahead.quiesce([seq])  # a release: the call in flight is cancelled and waited for
    assert gate[1].is_set and ahead._ahead.future.done()


def run(engine, requests: list[Request]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Outputs by request id, and the lookahead's totals."""
    for r in requests:
        engine.add_request(r)
    seqs = dict(engine.running)
    totals = dict.fromkeys(("hits", "misses", "ready", "draft"), 0)
    while engine.has_unfinished():
        engine.step()
        s = engine.last_step
        for name, value in (("hits", s.lookahead_hits), ("misses", s.lookahead_misses),
                            ("ready", s.lookahead_ready), ("draft", s.draft_tokens)):
            totals[name] += value
    return {rid: seq.output_token_ids for rid, seq in seqs.items()}, totals


@pytest.mark.parametrize("scoring", ["batch-expansion", "multi-query"])
def test_greedy_output_is_the_targets_through_hits_and_misses(target_model, scoring):
    engine = build_inprocess_engine(target_model, near_copy(target_model, 0.05), scoring, 2,
                                    async_drafting="on")
    outs, totals = run(engine, [greedy_request(str(i), p, 40) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert outs[str(i)] == reference_greedy(target_model, p, 40), i
    # Both paths taken, many times: proposals drafted ahead were verified and emitted, and
    # chains after rejections were dropped (a chain used after a rejection fails above).
    assert totals["hits"] >= 10 and totals["misses"] >= 10 and totals["ready"] >= 10, totals


def test_the_ngram_proposer_drafts_ahead_too(target_model):
    """Prompt lookup's lookahead (nearly free): the output is the target's; this prompt's
    continuation repeats itself often enough for a few hits on the random tiny model."""
    prompt = [250, 2, 250]
    engine = build_inprocess_engine(target_model, "ngram", "multi-query", 3, ngram_min=1,
                                    async_drafting="on")
    outs, totals = run(engine, [greedy_request("0", prompt, 150)])
    assert outs["0"] == reference_greedy(target_model, prompt, 150)
    assert totals["hits"] > 0 and totals["ready"] > 0, totals


def test_seeded_sampled_output_is_the_same_with_lookahead_on_and_off(target_model):
    draft = near_copy(target_model, 0.05)
    requests = lambda: [Request(str(i), p, SamplingParams(seed=i, max_tokens=32, **PARAMS))  # noqa: E731
                        for i, p in enumerate(PROMPTS)]
    off, _ = run(build_inprocess_engine(target_model, draft, "multi-query", 2), requests())
    on, totals = run(build_inprocess_engine(target_model, draft, "multi-query", 2,
                                            async_drafting="on"), requests())
    assert on == off
    assert totals["hits"] > 0 and totals["misses"] > 0, totals


@torch.inference_mode()
def target_path_probs(model, prompt: list[int], params: SamplingParams, n: int
                      ) -> dict[tuple, float]:
    """The target's exact probability of every n-token continuation (full recomputation)."""
    def walk(tokens, p):
        if len(tokens) == len(prompt) + n:
            yield tuple(tokens[len(prompt):]), p
            return
        dist = truncated_probs(model(torch.tensor([tokens])).logits[0, -1:], params)[0]
        for t in dist.nonzero().flatten().tolist():
            yield from walk(tokens + [t], p * float(dist[t]))
    return dict(walk(list(prompt), 1.0))


def test_tokens_drafted_ahead_follow_the_target_distribution(target_model):
    """Tokens 3 and 4 of 3000 seeded requests (k = 1): token 4 is a proposal drafted ahead
    whenever token 3 was the bonus the draft guessed (seeded per position: the same tokens in
    whatever batches they run). The draft differs from the target
    enough that a proposal verified against the wrong draft distribution (e.g. that of
    the guess before it) fails outright (p ~ 1e-25), and agrees often enough to hit."""
    prompt, n, params = PROMPTS[0], 3000, dict(temperature=0.7, top_k=6)
    engine = build_inprocess_engine(target_model, near_copy(target_model, 0.2), "multi-query",
                                    1, async_drafting="on")
    outs, ready = {}, 0
    for chunk in range(0, n, 200):  # within the draft pool's 256 sequences: none evicted
        got, totals = run(engine, [Request(str(i), prompt, SamplingParams(
            seed=i, max_tokens=4, **params)) for i in range(chunk, chunk + 200)])
        outs, ready = {**outs, **got}, ready + totals["ready"]
    assert ready > 100, ready
    draws = [tuple(outs[str(i)][2:4]) for i in range(n)]
    expected: dict[tuple, float] = {}
    for path, p in target_path_probs(target_model, prompt, SamplingParams(**params), 4).items():
        expected[path[2:]] = expected.get(path[2:], 0.0) + p
    assert all(d in expected for d in draws), "a token outside the truncated support"
    assert chi_square_pvalue(draws, expected) > 1e-3


def test_a_full_draft_pool_drafts_nothing_ahead_rather_than_evict(draft_model):
    """96 token slots: one sequence of 60 holds 64 (whole blocks); a second one's lookahead of
    40 tokens would evict it, so that call proposes nothing. The same call in lockstep
    proposes (the pool then evicts, as it always may), and a lookahead that fits drafts."""
    from proposer_svc.draft import DraftModelProposer
    from specdecode.executor.model_runner import ModelRunner, RunnerRow
    from specdecode.executor.worker import ModelWorker

    runner = ModelRunner(draft_model, torch.device("cpu"), kv_cache_memory=100 * 1024 // 2)
    assert runner.pool.capacity_tokens == 96
    runner.forward([RunnerRow(1, list(range(60)), 1)])
    proposer = DraftModelProposer(ModelWorker(runner, "draft"))

    def call(tokens: list[int], ahead: bool) -> int:
        sg = SequenceGroupMetadata("r", False, {2: SequenceData(tokens[:4], tokens[4:])},
                                   SamplingParams(), num_speculative_tokens=3)
        req = ExecuteModelRequest([sg], num_lookahead_slots=3, draft_ahead=ahead)
        return int(proposer.get_proposals(req).proposal_lens[0])

    assert call(list(range(40)), ahead=True) == 0 and runner.pool.get(1) is not None
    assert call(list(range(10)), ahead=True) == 3  # fits: drafted, nobody evicted
    assert runner.pool.get(1) is not None and runner.pool.stats.evictions == 0
    assert call(list(range(40)), ahead=False) == 3 and runner.pool.stats.evictions == 1


@pytest.mark.parametrize("apart", [True, False])
def test_on_two_hosts_the_draft_computes_the_prompt_beside_the_target(target_model, apart):
    """Services on different hosts (no cores shared): the prompt step
    sends the whole prompts to the proposer beside the scoring call, so after it the draft
    holds each prompt and its first speculative step has nothing to catch up; the output
    stays the target's. Sharing cores, the prompt is not sent (the draft would contend with
    the target's prefill): it reads the prompt at its first speculative step."""
    engine = build_inprocess_engine(target_model, near_copy(target_model, 0.05), "multi-query",
                                    2, async_drafting="on")
    engine.warming.share_cores = not apart
    engine.ahead_pricing.contention = 0.0 if apart else 1.0
    for i, p in enumerate(PROMPTS):
        engine.add_request(greedy_request(str(i), p, 24))
    seqs = dict(engine.running)
    engine.step()  # every prompt computed
    assert [s.drafted for s in seqs.values()] == (
        [len(p) for p in PROMPTS] if apart else [0] * len(PROMPTS))
    while engine.has_unfinished():
        engine.step()
    for i, p in enumerate(PROMPTS):
        assert seqs[str(i)].output_token_ids == reference_greedy(target_model, p, 24), i


@pytest.mark.parametrize("apart", [True, False])
def test_on_two_hosts_plain_steps_keep_the_draft_current(target_model, apart):
    """Services on different hosts: a step that decodes plainly sends the decoding rows that
    may speculate to the proposer beside the scoring call (as prompt rows: it computes their
    KV state, proposes nothing), so when they speculate again the draft reads one token,
    not every token of the plain steps. A request with k = 0 is not sent (it never
    speculates). Sharing cores, nothing is sent and the draft falls behind. The policy
    decodes plainly for the first 6 steps, then speculates; the output stays the target's."""
    engine = build_inprocess_engine(target_model, near_copy(target_model, 0.05), "multi-query", 2)
    engine.warming.share_cores = not apart
    calls, propose = [], engine.proposer.get_proposals
    engine.proposer.get_proposals = lambda req: (calls.append(req), propose(req))[1]
    plan = engine.policy.plan
    engine.policy.plan = lambda cands: (dataclasses.replace(plan(cands), ks=[0] * len(cands))
                                        if engine.steps <= 6 else plan(cands))
    engine.add_request(greedy_request("spec", PROMPTS[1], 24))
    engine.add_request(greedy_request("plain", PROMPTS[3], 24, num_speculative_tokens=0))
    seqs = dict(engine.running)
    while engine.steps < 6:
        engine.step()
    behind = {name: len(s.token_ids) - s.drafted for name, s in seqs.items()}
    assert behind["spec"] == (1 if apart else len(seqs["spec"].token_ids))
    assert behind["plain"] == (len(seqs["plain"].token_ids) - len(PROMPTS[3]) if apart
                               else len(seqs["plain"].token_ids))  # the prompt only
    sent = [sg for req in calls for sg in req.seq_group_metadata_list]
    assert all(sg.is_prompt for sg in sent) and len(calls) == (6 if apart else 0)
    engine.step()  # speculates: the draft read the step's token and proposed
    assert calls[-1].num_lookahead_slots == 2 and seqs["spec"].stats.draft_tokens > 0
    while engine.has_unfinished():
        engine.step()
    assert seqs["spec"].output_token_ids == reference_greedy(target_model, PROMPTS[1], 24)
    assert seqs["plain"].output_token_ids == reference_greedy(target_model, PROMPTS[3], 24)


class ServiceClock:
    """An in-process proposer that reports its busy seconds as a remote one does
    (`service_seconds`, orchestrator.engine.service_stats)."""

    def __init__(self, proposer):
        self.proposer, self.service_seconds = proposer, 0.0

    def get_proposals(self, req):
        start = time.perf_counter()
        try:
            return self.proposer.get_proposals(req)
        finally:
            self.service_seconds += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self.proposer, name)


@pytest.mark.parametrize("async_drafting", ["on", "off"])
def test_a_step_that_drafts_ahead_teaches_no_proposer_rpc(target_model, async_drafting):
    """The proposer's busy seconds in a step with a lookahead include the lookahead's
    drafting, so its call less them reads negative (it did on two hosts: the learned RPC
    sat at its clamp, 0). Such steps teach no RPC (fails with them taught: negative
    samples); lockstep steps still do. The draft is the target's own function at an eighth
    of its layers, so the policy speculates on any machine."""
    target, draft = self_drafting_pair(8, 512)
    engine = build_inprocess_engine(target, draft, "multi-query", 3, adaptive=True,
                                    async_drafting=async_drafting)
    engine.proposer = ServiceClock(engine.proposer)
    samples = []
    learned = engine.policy.propose_rpc_s
    add = learned.add
    learned.add = lambda value: (samples.append(value), add(value))
    engine.generate([greedy_request(str(i), p, 16) for i, p in enumerate(PROMPTS[:2])])
    assert all(value >= 0.0 for value in samples), samples
    if async_drafting == "off":
        assert samples
