"""Batch expansion as vLLM 0.4.2 does it, and multi-query scoring agreeing with it."""

from __future__ import annotations

import pytest
import torch

from scorer_svc.batch_expansion import BatchExpansionTop1Scorer, expand_batch, token_ids_to_score
from scorer_svc.multi_query import MultiQueryScorer
from specdecode.interfaces import SpeculativeProposals
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)
from tests.support.models import worker


def group(seq_id: int, prompt: list[int], output: list[int], params=None) -> SequenceGroupMetadata:
    return SequenceGroupMetadata(str(seq_id), is_prompt=not output,
                                 seq_data={seq_id: SequenceData(prompt, output)},
                                 sampling_params=params or SamplingParams())


def proposals(token_lists: list[list[int]], k: int) -> SpeculativeProposals:
    ids = torch.full((len(token_lists), k), -1, dtype=torch.long)
    for i, t in enumerate(token_lists):
        ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    return SpeculativeProposals(ids, None, torch.tensor([len(t) for t in token_lists]))


def test_token_ids_to_score_k4():
    assert token_ids_to_score([10, 11, 12, 13]) == [[], [10], [10, 11], [10, 11, 12],
                                                    [10, 11, 12, 13]]
    assert token_ids_to_score([]) == [[]]


def test_expansion_ids_order_and_tokens():
    groups = [group(3, [1, 2], [5]), group(7, [4], []), group(11, [6, 6], [8, 9])]
    req = ExecuteModelRequest(groups, num_lookahead_slots=2)
    batch = expand_batch(req, proposals([[20, 21], [], [30]], 2))
    assert batch.spec_indices == [0, 2] and batch.non_spec_indices == [1]
    assert batch.num_scoring_tokens == 3 + 2
    spec_rows = batch.target_groups[:batch.num_scoring_tokens]
    # Target ids count from max(all input ids)+1, the non-speculating one included.
    assert [g.seq_id for g in spec_rows] == [12, 13, 14, 15, 16]
    assert all(g.seq_id > 11 for g in spec_rows)
    assert [g.data.get_token_ids() for g in spec_rows] == [
        [1, 2, 5], [1, 2, 5, 20], [1, 2, 5, 20, 21], [6, 6, 8, 9], [6, 6, 8, 9, 30]]
    # Expanded rows read their parent's KV cache; the non-spec row is passed through as is.
    assert [g.kv_cache_id for g in spec_rows] == [3, 3, 3, 11, 11]
    assert batch.target_groups[-1] is groups[1]


def test_contraction_places_rows(target_model):
    greedy_logprobs = SamplingParams(logprobs=0)
    groups = [group(0, [1, 2, 3], [4], greedy_logprobs), group(1, [9, 9], [], greedy_logprobs),
              group(2, [5], [6, 7], greedy_logprobs)]
    req = ExecuteModelRequest(groups, num_lookahead_slots=3)
    props = proposals([[10, 11, 12], [], [13]], 3)
    scores = BatchExpansionTop1Scorer(worker(target_model, "target")).score_proposals(req, props)
    assert scores.token_ids.shape == (3, 4)
    assert scores.probs is None  # greedy batch: token ids are all verification needs
    tid = scores.token_ids
    assert (tid[0] >= 0).all()
    assert tid[1, 0] >= 0 and (tid[1, 1:] == -1).all()
    assert (tid[2, :2] >= 0).all() and (tid[2, 2:] == -1).all()
    lp = scores.logprobs
    assert torch.isinf(lp[1, 1:]).all() and (lp[1, 1:] < 0).all()
    assert torch.isfinite(lp[1, 0]).all()
    # Each scored position is the target's argmax after the given tokens.
    with torch.inference_mode():
        for i, cont in [(0, [4]), (0, [4, 10, 11, 12]), (1, []), (2, [6, 7, 13])]:
            tokens = groups[i].data.prompt_token_ids + cont
            col = len(cont) - len(groups[i].data.output_token_ids)
            want = target_model(torch.tensor([tokens])).logits[0, -1].argmax()
            assert tid[i, col] == want


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batch_expansion_equals_multi_query(target_model, temperature):
    params = SamplingParams(temperature=temperature, top_k=50, top_p=0.9, seed=7, logprobs=0)
    groups = [group(0, [1, 2, 3], [4], params), group(1, [9, 9], [], params),
              group(2, [5], [6, 7], params), group(3, [8, 8, 8, 8], [1], params)]
    req = ExecuteModelRequest(groups, num_lookahead_slots=4)
    props = proposals([[10, 11, 12, 13], [], [13], [2, 3]], 4)
    be = BatchExpansionTop1Scorer(worker(target_model, "target")).score_proposals(req, props)
    mq = MultiQueryScorer(worker(target_model, "target")).score_proposals(req, props)
    assert torch.equal(be.token_ids, mq.token_ids)
    assert torch.allclose(be.logprobs.nan_to_num(neginf=-1e9), mq.logprobs.nan_to_num(neginf=-1e9),
                          atol=1e-4)
    if temperature:
        assert torch.allclose(be.probs, mq.probs, atol=1e-5)
        # Truncation is part of p: top-k 50 and top-p 0.9 leave at most 50 tokens.
        assert ((be.probs[0] > 0).sum(-1) <= 50).all()
