"""Sampling through the whole engine: emitted tokens follow the target distribution
(truncation included), and a seeded request is reproducible whatever its batch mates."""

from __future__ import annotations

import pytest

from orchestrator.engine.request import Request
from specdecode.sequence import SamplingParams
from tests.support.chi_square import chi_square_pvalue
from tests.support.models import make_engine
from tests.support.references import target_pair_probs

PROMPT = [5, 17, 99, 3, 42]
PARAMS = dict(temperature=1.0, top_k=6, top_p=0.95)


def sampled_pairs(engine, n: int) -> tuple[list[tuple[int, int]], int]:
    """First two tokens of n requests with seeds 0..n-1, run as one batch: the first comes
    from the target (a prompt step), the second from a speculative step."""
    done = engine.generate([Request(str(i), PROMPT, SamplingParams(seed=i, max_tokens=2, **PARAMS))
                            for i in range(n)])
    draft_tokens = sum(seq.stats.draft_tokens for seq in done.values())
    return [tuple(done[str(i)].output_token_ids) for i in range(n)], draft_tokens


@pytest.mark.parametrize("proposer", ["draft", "self", "ngram"])
def test_emitted_tokens_follow_the_target_distribution(target_model, draft_model, proposer):
    draft = {"draft": draft_model, "self": target_model, "ngram": "ngram"}[proposer]
    engine = make_engine(target_model, draft, "batch-expansion", 2)
    n = 3000
    pairs, draft_tokens = sampled_pairs(engine, n)
    if proposer != "ngram":
        assert draft_tokens > 0  # the second token went through rejection sampling
    expected = target_pair_probs(target_model, PROMPT, SamplingParams(**PARAMS))
    assert all(pair in expected for pair in pairs), "a token outside the truncated support"
    assert chi_square_pvalue(pairs, expected) > 1e-3


def test_seeded_request_is_reproducible_across_batches_and_scorers(target_model, draft_model):
    def run(scoring, mates):
        engine = make_engine(target_model, draft_model, scoring, 3)
        requests = [Request("me", PROMPT, SamplingParams(seed=1234, max_tokens=16, **PARAMS))]
        requests += [Request(f"m{i}", [i + 1] * (i + 2), SamplingParams(seed=i, max_tokens=9,
                                                                          **PARAMS))
                     for i in range(mates)]
        return engine.generate(requests)["me"].output_token_ids
    alone = run("batch-expansion", 0)
    assert run("batch-expansion", 5) == alone
    assert run("multi-query", 3) == alone
    other_seed = make_engine(target_model, draft_model, "batch-expansion", 3).generate(
        [Request("x", PROMPT, SamplingParams(seed=99, max_tokens=16, **PARAMS))])["x"]
    assert other_seed.output_token_ids != alone
