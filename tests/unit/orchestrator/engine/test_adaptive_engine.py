"""The engine with adaptive k, auto scoring, a pruned draft head and early stop: what it
tells the policy, and losslessness on the tiny random models whatever k the policy
picks (greedy: the target's own output; sampled: its distribution)."""

from __future__ import annotations

import pytest
import torch

from orchestrator.engine.request import Request
from proposer_svc.pruned_head import PrunedLMHead
from scorer_svc.auto import AutoScorer
from specdecode.cost_model import ForwardCosts
from specdecode.sequence import SamplingParams
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model
from specdecode_stack.inprocess import build_inprocess_engine
from tests.support.adaptive import MAX_TOKENS, PROMPTS, TOKENS, policy
from tests.support.chi_square import chi_square_pvalue
from tests.support.models import CPU, TARGET, greedy_request
from tests.support.references import reference_greedy, target_pair_probs


def flat_at_any_batch(decode: float, per_token: float) -> ForwardCosts:
    """A table as wide in rows as any test batch (3,000 requests at once), so that no row
    count is priced beyond it (by its tokens in all: compute-bound, speculation never pays)."""
    return ForwardCosts([1, 4096], TOKENS, [[decode + per_token * (q - 1) for q in TOKENS]] * 2)


def adaptive_engine(target, draft, draft_vocab_size: int = 0, k: int = 4,
                    draft_confidence: float = 0.0):
    """Adaptive k and auto scoring on costs that make speculation pay (flat verify, cheap
    draft), so the policy varies k instead of settling on 0 from the tiny models' noise."""
    engine = build_inprocess_engine(target, draft, "auto", k, CPU, ngram_min=1,
                                    adaptive=False, draft_vocab_size=draft_vocab_size,
                                    draft_confidence=draft_confidence)
    costs = flat_at_any_batch(0.01, 0.0005)
    engine.scorer = AutoScorer(engine.scorer.worker, costs)
    draft_costs = flat_at_any_batch(0.001, 0.0) if draft != "ngram" else None
    engine.policy = policy(costs, draft_costs, k_max=k,
                           measure_overheads=False)  # decisions independent of this host
    return engine


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
    (chi-square as in test_sampling.py, alpha = 1e-3, fixed seeds)."""
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
