"""Speculate only where it pays: measured forward costs, the adaptive speculation policy,
auto scoring and the pruned draft head. Policy decisions are checked on fixed synthetic
costs (deterministic); losslessness on the tiny random models, whatever k the policy picks."""

from __future__ import annotations

import pytest
import torch

from bench.tiny_models import TinyModelSpec, build_tiny_model
from orchestrator.engine.request import Request
from orchestrator.engine.speculation_policy import (REASONS, Candidate, SpeculationPolicy,
                                                    expected_tokens)
from proposer_svc.pruned_head import PrunedLMHead, frequency_order, prune_lm_head
from scorer_svc.auto import AutoScorer
from specdecode.cost_model import ForwardCosts, calibrate, cheaper_scoring, verify_seconds
from specdecode.model_info import ModelInfo
from specdecode.model_runner import ModelRunner
from specdecode.errors import InvalidRequestError
from specdecode.sequence import SamplingParams
from specdecode.wire import model_info_from_proto, model_info_to_proto
from specdecode_stack.inprocess import build_inprocess_engine
from tests.conftest import (CPU, TARGET, chi_square_pvalue, greedy_request, reference_greedy,
                            target_pair_probs)

ROWS, TOKENS = [1, 4], [1, 2, 3, 5, 9]


def table(decode: float, per_token: float, per_row: float = 0.0,
          tokens: list[int] = TOKENS) -> ForwardCosts:
    """decode seconds for one row and token, + per_token for each further query token,
    + per_row for each further row (times its tokens)."""
    return ForwardCosts(ROWS, tokens, [[decode + per_token * (q - 1) + per_row * (r - 1) * q
                                        for q in tokens] for r in ROWS])


# -- cost model ------------------------------------------------------------------------------

def test_forward_costs_interpolate_extrapolate_and_stay_monotone_across_rows():
    costs = table(1.0, 0.5)
    assert costs(1, 1) == pytest.approx(1.0)
    assert costs(1, 4) == pytest.approx(2.5)  # between the 3- and 5-token points
    assert costs(1, 13) == pytest.approx(7.0)  # linear beyond the last token point
    assert costs(8, 1) == pytest.approx(2.0)  # per-row time of the last row point, x 8
    # fp32 on CPU: a 2-token forward measured faster than a decode is kept as measured (no
    # envelope across widths: it lifted every wider verify to the slowest narrower one) ...
    fp32 = ForwardCosts([1, 4], [1, 2, 3], [[1.0, 0.4, 2.0], [0.9, 1.0, 2.5]])
    assert fp32(1, 2) == pytest.approx(0.4)
    assert fp32(4, 1) == pytest.approx(1.0)  # ... but more rows never cost less
    assert fp32.observe(1, 3, 4.0) and fp32(1, 3) == pytest.approx(2.4)  # EWMA 0.2
    assert not fp32.observe(1, 4, 9.9)  # not a grid point: ignored
    with pytest.raises(ValueError, match="2x5"):
        ForwardCosts(ROWS, TOKENS, [[1.0] * 5])


def test_verify_cost_by_scoring_method():
    costs = table(1.0, 0.1, per_row=0.2)
    lens = [4, 0, 2]
    # multi-query feeds each row its own tokens (5 + 1 + 3, packed): 3 rows at their mean width
    assert verify_seconds(costs, "multi-query", lens) == costs(3, 3)
    assert verify_seconds(costs, "batch-expansion", lens) == costs(5 + 1 + 3, 5)
    # Expanded rows are padded to the same width, so batch expansion never costs less in
    # this runner; auto scoring therefore picks multi-query whenever costs are monotone.
    assert cheaper_scoring(costs, lens) == "multi-query"
    assert cheaper_scoring(costs, [0, 0]) == "multi-query"


def test_calibrate_times_every_cell_and_leaves_no_cache(target_model):
    runner = ModelRunner(target_model, CPU)
    seen = []
    runner.on_forward = seen.append
    costs = calibrate(runner, rows=(1, 2), tokens=(1, 3), repeats=1, context=8)
    assert costs.rows == [1, 2] and costs.tokens == [1, 3]
    assert all(s > 0 for line in costs.seconds for s in line)
    assert runner.num_cached_sequences == 0 and not seen  # not traffic: no hook, no counters
    assert runner.stats.forward_calls == 0 and runner.stats.tokens_computed == 0


def test_model_info_carries_forward_costs_over_the_wire():
    info = ModelInfo("m", 256, "fp", 128, role="scorer", scoring_method="auto",
                     forward_cost=table(0.3, 0.1))
    back = model_info_from_proto(model_info_to_proto(info))
    assert back.forward_cost.seconds == info.forward_cost.seconds
    assert back.scoring_method == "auto"
    assert model_info_from_proto(model_info_to_proto(ModelInfo("ngram", 0, "", 9))).forward_cost is None
    bad = model_info_to_proto(info)
    del bad.forward_cost.seconds[-1]
    with pytest.raises(InvalidRequestError, match="forward_cost"):
        model_info_from_proto(bad)


# -- the policy ------------------------------------------------------------------------------

def policy(scorer: ForwardCosts, draft: ForwardCosts | None, k_max: int = 8,
           prior: float = 0.6, **kw) -> SpeculationPolicy:
    return SpeculationPolicy(k_max, scorer_costs=scorer, draft_costs=draft,
                             draft_model=draft is not None, prior=prior, **kw)


def teach(p: SpeculationPolicy, seq_id: int, alpha_prefix: int, k: int, steps: int = 10):
    for _ in range(steps):
        p.observe(seq_id, k, k, alpha_prefix)


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5.0


def test_policy_speculates_when_verify_is_flat_and_acceptance_high():
    p = policy(table(0.25, 0.0), table(0.02, 0.0))  # fast-bf16-like: verify ~ decode
    teach(p, 1, 4, 4)  # every proposal accepted
    plan = p.plan([Candidate(1, 8)])
    assert plan.ks == [8] and plan.scoring == "multi-query"


def test_policy_stops_when_multi_token_forwards_are_slow():
    """The issue's AVX2 CPU: a 5-token verify costs ~3.75 decodes; even 96% acceptance
    does not pay with a draft costing a third of the target."""
    p = policy(table(0.37, 0.255), table(0.12, 0.05))
    teach(p, 1, 4, 4)
    assert p.plan([Candidate(1, 8)]).ks == [0]


def test_policy_stops_on_low_acceptance_and_keeps_the_request_cap():
    p = policy(table(0.25, 0.01), table(0.03, 0.0, per_row=0.03))  # draft rows cost
    teach(p, 1, 4, 4)  # high acceptance
    teach(p, 2, 0, 4)  # always rejected at the first token
    plan = p.plan([Candidate(1, 2), Candidate(2, 8), Candidate(3, 0)])
    assert plan.ks == [2, 0, 0]  # 2: the request's cap; 3: a prompt step


def test_policy_stops_for_a_large_compute_bound_batch():
    # Flat at one row (memory-bound), then compute-bound: 10 ms per row-token beyond 50 ms.
    costs = ForwardCosts(ROWS, TOKENS, [[max(0.05, 0.01 * r * q) for q in TOKENS] for r in ROWS])
    p = policy(costs, table(0.005, 0.0))
    for s in range(8):
        teach(p, s, 1, 4)  # ~60% acceptance
    assert max(p.plan([Candidate(0, 8)]).ks) > 0
    assert p.plan([Candidate(s, 8) for s in range(8)]).ks == [0] * 8


def test_policy_learns_acceptance_and_ngram_proposal_rate():
    p = policy(table(0.25, 0.05), None)  # n-gram: no draft forwards
    teach(p, 1, 4, 4)
    assert p.plan([Candidate(1, 4)]).ks == [4]
    hit = p.plan([Candidate(1, 4)]).expected_tokens
    for _ in range(30):  # the proposer stops finding n-grams: fewer expected tokens
        p.observe(1, 4, 0, 0)
    assert p.plan([Candidate(1, 4)]).expected_tokens < 0.5 * hit
    teach(p, 1, 0, 4, steps=30)  # then it finds some, and all are rejected (prose)
    assert p.plan([Candidate(1, 4)]).ks == [0]


def run_steps(p: SpeculationPolicy, steps: int, true_costs: ForwardCosts, accept: bool,
              rpc_s: float = 0.004) -> list:
    """Drive the policy as the engine does, one n-gram sequence whose proposals are all
    accepted (accept) or all rejected, the step times taken from true_costs."""
    plans = []
    for _ in range(steps):
        plan = p.plan([Candidate(1, 4)])
        k = plan.ks[0]
        p.observe(1, k, k, k if accept else 0)
        score_s = rpc_s + true_costs(1, k + 1)
        p.observe_step(plan, [k], 0.001 if k else 0.0, score_s, score_s + 0.002)
        plans.append(plan)
    return plans


def test_policy_mends_a_start_up_table_that_wrongly_says_never_speculate():
    """The table measured at start-up while the other service loaded on the same cores:
    2+ tokens 4x a decode (the stack's real log showed 0.244 s against 0.064 s). The real
    verify costs 1.1x a decode; on a copy task every proposal is accepted."""
    wrong, true = table(0.06, 0.18), table(0.06, 0.0015)
    assert policy(wrong, None).plan([Candidate(1, 4)]).ks == [0]
    plans = run_steps(policy(wrong, None), 40, true, accept=True)
    first = next(i for i, plan in enumerate(plans) if plan.ks[0])
    assert plans[first].explore and first < 10  # measured after EXPLORE_FIRST plain steps
    # then k grows with the sequence's own accepted tokens (at most 4x them) and stays at 4
    assert [plan.ks[0] for plan in plans[first:first + 3]] == [1, 4, 4]
    assert all(plan.ks == [4] and not plan.explore for plan in plans[first + 1:][1:])


def test_exploring_costs_little_when_the_table_is_right():
    """The issue's AVX2 CPU: speculation truly does not pay. Exploration doubles its wait
    each time (8, 16, ... 256 plain steps), so over 2,000 steps it speculates a handful of
    times and the steps take under 1% longer than plain decoding alone."""
    costs = table(0.37, 0.255)
    plans = run_steps(policy(costs, None), 2000, costs, accept=False)
    spec = [plan for plan in plans if plan.ks[0]]
    assert all(plan.explore for plan in spec) and 5 <= len(spec) <= 12
    spent = sum(costs(1, plan.ks[0] + 1) for plan in plans)
    assert spent < 1.01 * 2000 * costs(1, 1)


def test_a_new_sequence_speculates_on_its_own_evidence():
    """Other sequences accepted everything (a high prior), so a new one speculates, but k
    grows with what it had accepted itself: 2, then 8 (at least 2, at most four times its
    accepted tokens); one rejected at its first proposals stays at 2."""
    p = policy(table(0.25, 0.0), table(0.02, 0.0))
    teach(p, 1, 8, 8)
    ks = []
    for _ in range(3):
        ks.append(p.plan([Candidate(2, 8)]).ks[0])
        p.observe(2, ks[-1], ks[-1], ks[-1])
    assert ks == [2, 8, 8]
    assert p.plan([Candidate(3, 8)]).ks == [2]
    p.observe(3, 2, 2, 0)
    assert p.plan([Candidate(3, 8)]).ks[0] <= 2


def test_a_sequence_never_speculates_past_its_end():
    """k + 1 tokens at most per step: a request with 3 tokens left asks for 2, with 1 left
    for none (drafting 16 for the last 6 tokens of a 32-token request cost copy 20%); nor
    wider than the scorer's table measured."""
    p = policy(table(0.25, 0.0, tokens=list(range(1, 18))), table(0.02, 0.0), k_max=16)
    teach(p, 1, 16, 16)
    assert p.plan([Candidate(1, 16, remaining=100)]).ks == [16]
    narrow = policy(table(0.25, 0.0), table(0.02, 0.0), k_max=16)  # widths 1-9 measured
    teach(narrow, 1, 16, 16)
    assert narrow.plan([Candidate(1, 16, remaining=100)]).ks == [8]
    assert p.plan([Candidate(1, 16, remaining=1)]).reasons == ["capped"]
    assert p.plan([Candidate(1, 16, remaining=3)]).ks == [2]
    assert p.plan([Candidate(1, 16, remaining=1)]).ks == [0]


def test_catch_up_is_spread_over_the_tokens_left():
    """A draft that missed 100 tokens reads them in its first forward (10 ms a token here):
    worth it for a request with 64 tokens to go (spread over its ~21 speculative steps),
    not for one with 3 (the whole catch-up lands on one step)."""
    p = policy(table(0.2, 0.01), table(0.02, 0.01))  # verify ~ decode: speculation pays
    teach(p, 1, 3, 4)
    assert p.plan([Candidate(1, 4, behind=1, remaining=64)]).ks == [4]
    far_behind = p.plan([Candidate(1, 4, behind=100, remaining=64)])
    assert far_behind.ks == [4] and far_behind.catch_up_s == pytest.approx(0.98)
    assert p.plan([Candidate(1, 4, behind=100, remaining=3)]).ks == [0]


def test_a_catch_up_teaches_its_own_factor():
    """A catch-up forward 3x dearer than the table (a long prefill) must not make the
    draft's steady steps look 3x dearer too: they keep their own factor."""
    p = policy(table(0.2, 0.01), table(0.02, 0.01))
    teach(p, 1, 3, 4)
    plan = p.plan([Candidate(1, 4, behind=1, remaining=60)])
    p.observe_step(plan, [4], 2 * plan.draft_s, 0.24, 0.24 + 2 * plan.draft_s)
    assert p.draft_factor.value == pytest.approx(2.0) and p.catch_up_factor.value == 1.0
    plan = p.plan([Candidate(1, 4, behind=50, remaining=64)])
    assert plan.ks[0] and plan.catch_up == pytest.approx(0.48)
    propose_s = 2 * plan.draft_s + 3 * plan.catch_up
    p.observe_step(plan, plan.ks, propose_s, 0.24, 0.24 + propose_s)
    assert p.draft_factor.value == pytest.approx(2.0) and p.catch_up_factor.value == pytest.approx(3.0)


def run_draft_steps(p: SpeculationPolicy, steps: int, scorer: ForwardCosts, draft: ForwardCosts,
                    prompt: int = 40, rpc_s: float = 0.004, accept: bool = False) -> list:
    """Drive the policy as the engine does, one sequence of a draft model whose proposals
    are all rejected (or all accepted), the step times taken from the true costs `scorer`
    and `draft` (the policy may hold other tables); the draft reads what it missed in its
    first forward (catch-up)."""
    plans, behind, left = [], prompt + 1, steps
    while left > 0:
        plan = p.plan([Candidate(1, 4, behind=behind, remaining=left)])
        k = plan.ks[0]
        p.observe(1, k, k, k if accept else 0)
        propose_s = rpc_s + draft(1, behind) + (k - 1) * draft(1, 1) if k else 0.0
        score_s = rpc_s + scorer(1, k + 1)
        p.observe_step(plan, [k], propose_s, score_s, propose_s + score_s + 0.002)
        behind = (2 if accept else 1) if k else behind + 1
        left -= k + 1 if accept else 1
        plans.append((plan, propose_s + score_s))
    return plans


def test_exploring_with_a_draft_pays_for_its_catch_up():
    """The issue's AVX2 CPU with a draft model: speculation does not pay, and exploring
    makes the draft read the prompt and every token decoded plainly since (12 ms a draft
    token here). A 64-token request is not explored at all: the first exploration's catch-up
    would cost over 3% of the request's plain time (measured: one probe cost a 64-token bf16
    request ~17%), and later ones must fit in 2% of the sequence's own plain time, whatever
    other requests decoded plainly before. A long request checks the start-up table once
    after 8 plain steps; with a cheaper catch-up it is explored now and then, and all of it
    costs under 2% over plain decoding."""
    scorer, draft = table(0.37, 0.255), table(0.05, 0.012)
    p = policy(scorer, draft)
    assert not any(plan.ks[0] for plan, _ in run_draft_steps(p, 64, scorer, draft))
    p.forget([1])
    for _ in range(500):  # other requests decoding plainly (k=0): no budget saved for the next
        p.observe(2, 0, 0, 0)
        p.observe_step(p.plan([Candidate(2, 0)]), [0], 0.0, 0.374, 0.376)
    assert not any(plan.ks[0] for plan, _ in run_draft_steps(p, 64, scorer, draft))
    plans = run_draft_steps(policy(scorer, draft), 300, scorer, draft)
    assert [i for i, (plan, _) in enumerate(plans) if plan.ks[0]][:1] == [8]
    draft = table(0.05, 0.004)
    plans = run_draft_steps(policy(scorer, draft), 2000, scorer, draft)
    assert 2 <= sum(1 for plan, _ in plans if plan.ks[0])
    assert all(plan.explore for plan, _ in plans if plan.ks[0])
    assert sum(s for _, s in plans) < 1.02 * 2000 * (0.004 + scorer(1, 1))


def test_a_probe_with_catch_up_mends_a_draft_table_measured_under_load():
    """The fast-bf16 EPYC through the stack: the draft calibrated while the target loaded on
    the same cores reported 1.07 s a forward, against ~0.1 s in traffic (the target's
    table was 1.5x off). The first exploration's draft forward also reads the prompt
    (catch-up), so its time cannot tell the steady cost from the catch-up's: before the
    steady cost was ever measured, both take the same factor. (Charged to the catch-up
    alone, the probe left the steady draft steps priced at 1.07 s and the stack decoded
    accepted code at k=0 for good.) The first plain step runs 0.61x the table's decode:
    the factors are rescaled to that host and the tables count as unchecked, so a 256-token
    request of accepted code is probed at its second step (it waited 8 plain steps before),
    then ramps 1, 2, 4 and stays at 4 (but at its end): 0.50 of plain decoding's time (0.6
    allowed; at k=0 it was 1.0). The probe's predicted loss on this wrong table exceeds 3%
    of a 64-token request's plain time, so that one is not probed (the price of bounding
    what a probe may cost a short request): its reason is no_budget."""
    true_scorer, true_draft = table(0.30, 0.01), table(0.10, 0.004)
    wrong_scorer, wrong_draft = table(0.50, 0.01), table(1.07, 0.03)  # as measured
    plans = run_draft_steps(policy(wrong_scorer, wrong_draft), 256, true_scorer, true_draft,
                            prompt=14, accept=True)
    ks = [plan.ks[0] for plan, _ in plans]
    first = next(i for i, k in enumerate(ks) if k)
    assert first == 1 and plans[first][0].explore and plans[first][0].catch_up > 0
    assert plans[0][0].reasons == ["exploration_pending"]
    assert ks[first:first + 3] == [1, 2, 4] and set(ks[first + 2:-1]) == {4}
    assert sum(s for _, s in plans) < 0.6 * 256 * (0.004 + true_scorer(1, 1))
    plans = run_draft_steps(policy(wrong_scorer, wrong_draft), 64, true_scorer, true_draft,
                            prompt=14, accept=True)
    assert not any(plan.ks[0] for plan, _ in plans)
    assert plans[1][0].reasons == ["no_budget"]


def test_engine_tells_the_policy_what_the_draft_missed(target_model):
    """After the prompt step the draft has read nothing (behind = prompt + the first token);
    after a speculative step it holds all but the bonus token (and the last proposal when
    every one was accepted): behind is 1 or 2."""
    engine = adaptive_engine(target_model, build_tiny_model(TARGET), 0)  # draft = target
    seen, plan = [], engine.policy.plan

    def recording(cands):
        seen.append([(c.behind, c.remaining) for c in cands])
        return plan(cands)
    engine.policy.plan = recording
    engine.add_request(greedy_request("0", PROMPTS[1], MAX_TOKENS))
    ks = []
    while engine.has_unfinished():
        engine.step()
        ks.append(engine.last_step.chosen_k[0])
    assert seen[1] == [(len(PROMPTS[1]) + 1, MAX_TOKENS - 1)] and ks[1] > 0
    after = [seen[i + 1][0][0] for i, k in enumerate(ks[:-1]) if k]
    assert after and all(b in (1, 2) for b in after)


def test_steps_that_compute_a_prompt_teach_the_policy_no_costs(target_model):
    """A prompt step costs a prefill, not a decode: learned as the time around a decode
    call, a 97-token prompt's 1.0 s priced every later step 0.15 s dearer (the fast-bf16
    EPYC, whose decode is 0.23 s), so speculation looked not to pay."""
    engine = adaptive_engine(target_model, "ngram")
    engine.policy.measure_overheads = True
    learned = []
    observe = engine.policy.observe_step
    engine.policy.observe_step = lambda plan, *args: (learned.append(plan.ks), observe(plan, *args))
    engine.add_request(greedy_request("0", PROMPTS[1], 4))
    engine.step()
    assert not learned and engine.policy.rpc_s.n == 0
    engine.add_request(greedy_request("1", PROMPTS[0], 4))  # joins the decoding one
    engine.step()
    assert not learned
    engine.step()
    assert len(learned) == 1 and len(learned[0]) == 2


def test_fixed_policy_speculates_the_cap():
    p = SpeculationPolicy(4, adaptive=False)
    assert p.plan([Candidate(1, 3), Candidate(2, 9), Candidate(3, 0)]).ks == [3, 4, 0]
    # adaptive without costs (an old service) also falls back to fixed k
    assert not SpeculationPolicy(4, scorer_costs=None).adaptive


# -- the pruned draft head --------------------------------------------------------------------

def test_pruned_head_scores_the_subset_and_minus_inf_elsewhere(draft_model):
    model = build_tiny_model(TinyModelSpec(seed=2, num_layers=1))
    head = model.get_output_embeddings()
    keep = torch.tensor([0, 3, 7, 100, 255])
    pruned = PrunedLMHead(head, keep)
    hidden = torch.randn(2, 3, head.weight.shape[1])
    full, out = head(hidden), pruned(hidden)
    assert out.shape == full.shape
    torch.testing.assert_close(out[..., keep], full[..., keep])
    mask = torch.ones(full.shape[-1], dtype=torch.bool)
    mask[keep] = False
    assert torch.isneginf(out[..., mask]).all()


def test_frequency_order_follows_bpe_merges(tmp_path):
    (tmp_path / "tokenizer.json").write_text(
        '{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "ba": 3, "bab": 4},'
        ' "merges": ["b a", "a b", "ba b"]}, "added_tokens": [{"id": 5}]}')
    # added token first, then bytes, then merges in order; ids no entry names go last
    assert frequency_order(tmp_path, 7) == [5, 0, 1, 3, 2, 4, 6]
    assert frequency_order(None, 3) == [0, 1, 2]


def test_prune_lm_head_keeps_eos():
    model = build_tiny_model(TinyModelSpec(seed=2, num_layers=1))
    model.config.eos_token_id = 200
    assert prune_lm_head(model, None, 64) == 65
    assert 200 in model.lm_head.keep.tolist()
    assert prune_lm_head(build_tiny_model(TinyModelSpec(seed=2, num_layers=1)), None, 0) == 256


# -- losslessness with all of it --------------------------------------------------------------

PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], [7, 8, 9, 7, 8, 9, 7, 8]]
MAX_TOKENS = 16


def adaptive_engine(target, draft, draft_vocab_size: int = 0, k: int = 4,
                    draft_confidence: float = 0.0):
    """Adaptive k and auto scoring on costs that make speculation pay (flat verify, cheap
    draft), so the policy varies k instead of settling on 0 from the tiny models' noise."""
    engine = build_inprocess_engine(target, draft, "auto", k, CPU, ngram_min=1,
                                    adaptive=False, draft_vocab_size=draft_vocab_size,
                                    draft_confidence=draft_confidence)
    costs = table(0.01, 0.0005)
    engine.scorer = AutoScorer(engine.scorer.worker, costs)
    engine.policy = policy(costs, table(0.001, 0.0) if draft != "ngram" else None, k_max=k,
                           measure_overheads=False)  # decisions independent of this host
    return engine


@pytest.mark.parametrize("proposer", ["draft", "pruned-draft", "ngram", "self"])
def test_greedy_equals_target_with_adaptive_k_auto_scoring_and_pruned_head(
        target_model, proposer):
    draft = {"ngram": "ngram", "self": build_tiny_model(TARGET)}.get(
        proposer, build_tiny_model(TinyModelSpec(seed=2, num_layers=1)))
    engine = adaptive_engine(target_model, draft, 64 if proposer == "pruned-draft" else 0)
    chosen = []
    requests = [greedy_request(str(i), p, MAX_TOKENS) for i, p in enumerate(PROMPTS)]
    for r in requests:
        engine.add_request(r)
    seqs = dict(engine.running)
    while engine.has_unfinished():
        engine.step()
        chosen += engine.last_step.chosen_k
    for i, p in enumerate(PROMPTS):
        assert seqs[str(i)].output_token_ids == reference_greedy(target_model, p, MAX_TOKENS)
    assert any(chosen)  # it did speculate ...
    if proposer == "self":  # ... and, accepting everything, went to the maximum k
        assert max(chosen) == 4
    if proposer == "pruned-draft":
        assert isinstance(draft.lm_head, PrunedLMHead)


def test_sampling_follows_the_target_with_adaptive_k_and_pruned_head(target_model):
    """The first two tokens of three per request, the second from a speculative step (k = 1:
    the policy asks for no more than the request can emit) of a draft whose head scores 64
    of 256 ids (q = 0 elsewhere): the pair still follows the target's joint distribution
    (chi-square as in test_engine_sampling, alpha = 1e-3, fixed seeds)."""
    params = dict(temperature=1.0, top_k=6, top_p=0.95)
    prompt = [5, 17, 99, 3, 42]
    engine = adaptive_engine(target_model, build_tiny_model(TARGET), draft_vocab_size=64, k=2)
    n = 3000
    done = engine.generate([Request(str(i), prompt, SamplingParams(seed=i, max_tokens=3, **params))
                            for i in range(n)])
    pairs = [tuple(done[str(i)].output_token_ids[:2]) for i in range(n)]
    assert sum(s.stats.draft_tokens for s in done.values()) > 0  # speculative second tokens

    expected = target_pair_probs(target_model, prompt, SamplingParams(**params))
    assert all(pair in expected for pair in pairs)
    assert chi_square_pvalue(pairs, expected) > 1e-3


def test_stack_defaults_are_lossless_and_report_costs(tiny_model_dirs, target_model,
                                                      monkeypatch):
    """The three services at their defaults (adaptive k, auto scoring) with a pruned draft
    head: greedy output equals the target's; both services report measured costs, each
    measured alone (a service starts once the one before it serves: timed while the other
    loaded, a table came out 8x off); the orchestrator exports the chosen k."""
    import re
    import urllib.request

    import grpc

    from specdecode.api.client import SpecDecodeClient
    from orchestrator.cluster.remote import RemoteProposer, RemoteScorer
    from specdecode_stack import local
    from specdecode_stack.local import LocalStack, StackConfig

    events = []
    spawn, wait = LocalStack._spawn, local.wait_process_serving
    monkeypatch.setattr(LocalStack, "_spawn", lambda self, role, *args: (
        events.append(("start", role)), spawn(self, role, *args))[1])
    monkeypatch.setattr(local, "wait_process_serving", lambda address, *args: (
        wait(address, *args), events.append(("serving", address)))[0])
    config = StackConfig(target_model=tiny_model_dirs["target"], draft_model=tiny_model_dirs["draft"],
                         tokenizer="none", device="cpu", port=0, draft_vocab_size=64)
    assert (config.scoring, config.speculation) == ("auto", "adaptive")
    with LocalStack(config) as stack:
        assert events == [("start", "scorer"), ("serving", stack.service_addresses["scorer"]),
                          ("start", "proposer"), ("serving", stack.service_addresses["proposer"]),
                          ("start", "orchestrator"), ("serving", stack.address)]
        with SpecDecodeClient(stack.address) as client:
            for p in PROMPTS:
                assert client.generate(p, max_tokens=MAX_TOKENS).token_ids == \
                    reference_greedy(target_model, p, MAX_TOKENS)
        for role, cls in (("proposer", RemoteProposer), ("scorer", RemoteScorer)):
            with grpc.insecure_channel(stack.service_addresses[role]) as channel:
                info = cls(channel).model_info()
            assert info.forward_cost.rows == [1, 4] and info.forward_cost(1, 5) > 0
        assert info.scoring_method == "auto"
        body = urllib.request.urlopen(
            f"http://127.0.0.1:{stack.metrics_ports['orchestrator']}/metrics").read().decode()
        counts = {m[1]: float(m[2]) for m in re.finditer(
            r'^specdecode_chosen_k_count\{[^}]*reason="(\w*)"[^}]*\} (\S+)$', body, re.M)}
        count = sum(counts.values())  # labels: model_name, reason
        assert counts["capped"] >= len(PROMPTS) and set(counts) <= set(REASONS)  # prompt steps
        assert re.search(r"^specdecode_predicted_speedup_count(?:\{[^}]*\})? [1-9]", body, re.M)
        assert count >= len(PROMPTS) * 2  # one per sequence-step, prompt steps included


# -- early stop: a draft stops after a token it is unsure of ----------------------------------

def draft_confidences(draft, prefix: list[int], n: int) -> tuple[list[int], list[float]]:
    """The draft's greedy continuation of `prefix` and each position's largest softmax
    probability (full recomputation: no cache, no batching)."""
    tokens, confidences = list(prefix), []
    with torch.inference_mode():
        for _ in range(n):
            probs = draft(torch.tensor([tokens])).logits[0, -1].float().softmax(-1)
            confidences.append(float(probs.max()))
            tokens.append(int(probs.argmax()))
    return tokens[len(prefix):], confidences


def test_an_unsure_draft_stops_after_the_token_it_was_unsure_of(draft_model):
    """Each sequence's proposal runs up to and including the first token whose probability
    under the draft is below the threshold; at 0 it is k long whatever the draft's
    confidence; the batch's other rows go on without it."""
    from proposer_svc.draft import DraftModelProposer
    from specdecode.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
    from tests.conftest import worker

    k, threshold = 8, 0.16
    prefixes = [p + [9] for p in PROMPTS]
    expected = []
    for p in prefixes:
        tokens, conf = draft_confidences(draft_model, p, k)
        n = next((j + 1 for j, c in enumerate(conf) if c < threshold), k)
        expected.append(tokens[:n])
    lens = [len(t) for t in expected]
    assert 1 in lens and max(lens) > 1 and min(lens) < k  # the threshold splits these drafts

    def request():
        return ExecuteModelRequest([SequenceGroupMetadata(
            str(i), False, {i: SequenceData(p[:-1], p[-1:])},
            SamplingParams(temperature=0.0), num_speculative_tokens=k)
            for i, p in enumerate(prefixes)], num_lookahead_slots=k)

    out = DraftModelProposer(worker(draft_model, "draft"), threshold).get_proposals(request())
    assert out.proposal_lens.tolist() == lens
    assert [row[:n] for row, n in zip(out.proposal_token_ids.tolist(), lens)] == expected
    assert all(t == -1 for row, n in zip(out.proposal_token_ids.tolist(), lens) for t in row[n:])
    full = DraftModelProposer(worker(draft_model, "draft"), 0.0).get_proposals(request())
    assert full.proposal_lens.tolist() == [k] * len(prefixes)
    with pytest.raises(ValueError, match="confidence"):
        DraftModelProposer(worker(draft_model, "draft"), 1.5)


def test_greedy_equals_target_with_early_stop(target_model):
    """Adaptive k up to 8, a draft (the target's twin: all accepted, so k ramps up) that
    stops after tokens below 0.3: its proposals come back shorter than asked, and the
    output is the target's own (rejections under early stop: the sampling test below)."""
    engine = adaptive_engine(target_model, build_tiny_model(TARGET), k=8, draft_confidence=0.3)
    asked_and_got, propose = [], engine.proposer.get_proposals

    def recording(req):
        out = propose(req)
        asked_and_got.extend((sg.num_speculative_tokens, int(n)) for sg, n in
                             zip(req.seq_group_metadata_list, out.proposal_lens))
        return out
    engine.proposer.get_proposals = recording
    max_tokens = 24
    done = engine.generate([greedy_request(str(i), p, max_tokens) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert done[str(i)].output_token_ids == reference_greedy(target_model, p, max_tokens)
    assert any(0 < got < asked for asked, got in asked_and_got)  # early stops happened ...
    assert any(got > 1 for _, got in asked_and_got)  # ... and longer drafts too


@torch.inference_mode()
def target_triple_probs(model, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """The target's exact joint of a request's first three tokens under its truncation."""
    from specdecode.sampling import truncated_probs

    def dist(tokens):
        return truncated_probs(model(torch.tensor([tokens])).logits[0, -1:], params)[0]
    joint = {}
    for (t1, t2), p12 in target_pair_probs(model, prompt, params).items():
        p3 = dist(prompt + [t1, t2])
        for t3 in p3.nonzero().flatten().tolist():
            joint[(t1, t2, t3)] = p12 * float(p3[t3])
    return joint


def test_sampling_follows_the_target_with_early_stop(target_model):
    """Fixed k = 2 after the prompt step, a draft (another model) that proposes its second
    token only when its first position's largest q reached the threshold (the median over
    the target's possible first tokens, so about half the draws stop early): the first three
    tokens still follow the target's joint distribution (chi-square, alpha = 1e-3, fixed
    seeds). The third token is the verified second proposal or, after an early stop, the
    bonus token at position 2 (a verifier that took the bonus from position k instead of
    the proposal's own length fails this test)."""
    from specdecode.sampling import truncated_probs

    params = dict(temperature=1.0, top_k=6, top_p=0.95)
    prompt = [5, 17, 99, 3, 42]
    draft = build_tiny_model(TinyModelSpec(seed=2, num_layers=1))
    firsts = target_pair_probs(target_model, prompt[:-1] + [prompt[-1]], SamplingParams(**params))
    with torch.inference_mode():
        max_q = sorted({t1: float(truncated_probs(draft(torch.tensor([prompt + [t1]])).logits[0, -1:],
                                                  SamplingParams(**params)).max())
                        for t1, _ in firsts}.values())
    threshold = (max_q[len(max_q) // 2 - 1] + max_q[len(max_q) // 2]) / 2
    engine = build_inprocess_engine(target_model, draft, "multi-query", 2, CPU,
                                    draft_confidence=threshold)
    n = 3000
    done = engine.generate([Request(str(i), prompt, SamplingParams(seed=i, max_tokens=3, **params))
                            for i in range(n)])
    triples = [tuple(done[str(i)].output_token_ids) for i in range(n)]
    drafts = [s.stats.draft_tokens for s in done.values()]
    assert 1 in drafts and 2 in drafts  # early stops and whole drafts
    expected = target_triple_probs(target_model, prompt, SamplingParams(**params))
    assert all(t in expected for t in triples)
    assert chi_square_pvalue(triples, expected) > 1e-3


def drive_early_stop(p: SpeculationPolicy, steps: int, scorer: ForwardCosts, draft: ForwardCosts,
                     stops_after: int, rpc_s: float = 0.004) -> list[tuple]:
    """One sequence of accepted code whose draft stops after `stops_after` tokens whatever
    it is asked for (all accepted), its step times from the true tables."""
    out, behind = [], 2
    for _ in range(steps):
        plan = p.plan([Candidate(1, 16, behind=behind)])
        k = plan.ks[0]
        n = min(k, stops_after)
        p.observe(1, k, n, n)
        propose_s = rpc_s + draft(1, behind) + (n - 1) * draft(1, 1) if k else 0.0
        score_s = rpc_s + scorer(1, n + 1)
        p.observe_step(plan, [n], propose_s, score_s, propose_s + score_s + 0.002)
        behind = 2 if k else behind + 1
        out.append((plan, propose_s + score_s + 0.002, n))
    return out


def test_policy_learns_that_drafts_stop_early():
    """A draft that stops after 2 tokens when asked for up to 16: the policy learns the
    continuation, predicts the 3 tokens and the step time such a step really has (within
    10%), and keeps the draft's cost factor at the table's (it priced the 2 forwards that
    ran, not the 16 asked for: charged as 16 the factor fell to ~0.2 and every later
    plan's draft steps were priced 5x too cheap)."""
    scorer, draft = table(0.20, 0.005), table(0.09, 0.002)
    p = policy(scorer, draft, k_max=16, prior=0.9)
    steps = drive_early_stop(p, 40, scorer, draft, stops_after=2)
    plan, seconds, n = steps[-1]
    assert plan.ks[0] > 2 and n == 2
    assert plan.expected_tokens == pytest.approx(3.0, rel=0.1)
    assert plan.seconds == pytest.approx(seconds, rel=0.1)
    assert p.draft_factor.value == pytest.approx(1.0, rel=0.1)
    assert p.seqs[1].continuation(1.0) < 0.65  # 0.5 learned, beside the prior of 1


def test_a_fresh_servers_first_request_probes_at_its_first_decode_step():
    """Native bf16 tables as measured (decode 0.20 s, a verify of 5 0.24 s, a draft step
    0.10 s): at the 0.6 prior a k = 1 step does not pay, so the first request on a fresh
    server used to decode 8 plain steps and then probe with a catch-up 8 tokens longer.
    Fully accepted at its cap (4) speculation would run over 1.5x faster on these tables,
    so it probes at its first decode step, where the catch-up is smallest; the AVX2 tables
    of test_exploring_with_a_draft_pays_for_its_catch_up (1.2x at best) still wait 8
    steps."""
    scorer, draft = table(0.20, 0.01), table(0.10, 0.003)
    plans = run_draft_steps(policy(scorer, draft), 64, scorer, draft, prompt=20, accept=True)
    first = next(i for i, (plan, _) in enumerate(plans) if plan.ks[0])
    assert first == 0 and plans[0][0].explore
    assert max(plan.ks[0] for plan, _ in plans) == 4  # and then speculates on its evidence


def test_ngram_copy_on_avx2_costs_speculates_k2_from_its_first_proposal():
    """bench13's AVX2-bf16 forwards (bench/ceiling.py: a verify of 2, 3, 5, 9 tokens costs
    1.48, 1.96, 3.66, 6.49 decodes): on a copy task k = 2 is the best k (1.53x a decode's
    tokens per second, k = 1 1.35x). A copy request's n-gram finds nothing for its first
    two proposals (the answer's first tokens are not in the prompt yet), then everything is
    accepted. On a warm server a new copy request proposes 2 from its first step; with
    trust starting at 1 and doubling it spent its first steps at k = 1 (measured through
    the stack: 1.04x own k=0 at a mean k of ~1, against a ceiling of 1.22-1.28x)."""
    ms = {1: 124, 2: 183, 3: 242, 5: 451, 9: 801}
    costs = ForwardCosts(ROWS, TOKENS, [[r * ms[q] / 1000 for q in TOKENS] for r in ROWS])
    p = policy(costs, None, k_max=8)
    for r in range(2):
        left, ks, asked = 63, [], 0
        while left > 0:
            plan = p.plan([Candidate(r, 8, remaining=left)])
            k = plan.ks[0]
            n = k if asked >= 2 else 0  # the n-gram finds nothing in its first two tries
            asked += 1 if k else 0
            p.observe(r, k, n, n)
            score_s = 0.004 + costs(1, n + 1)
            p.observe_step(plan, [n], 0.003 if k else 0.0, score_s, score_s + 0.004)
            ks.append(k)
            left -= n + 1
        p.forget([r])
    assert ks[:5] == [2] * 5 and sorted(ks)[len(ks) // 2] == 2
