"""Prompt lookup (n-gram): the earliest match of the longest n-gram, prompts skipped,
the maximum model length respected."""

from __future__ import annotations

from proposer_svc.ngram import NgramProposer, ngram_lookup
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData, SequenceGroupMetadata)


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], k=3, n_min=1, n_max=3) == [9, 1, 2]
    assert ngram_lookup([1, 2, 3, 4], k=3, n_min=1, n_max=3) == []
    # As in vLLM, the earliest match of the longest n-gram wins (the latest gave [2, 5]);
    # short tails give ragged proposals.
    assert ngram_lookup([5, 1, 5, 2, 5], k=4, n_min=1, n_max=1) == [1, 5, 2, 5]
    # The longest n-gram first: [2, 3] recurs once, [3] twice.
    assert ngram_lookup([3, 7, 2, 3, 8, 2, 3], k=2, n_min=1, n_max=2) == [8, 2]
    # The suffix never matches itself.
    assert ngram_lookup([4, 4], k=2, n_min=1, n_max=2) == [4]


def test_ngram_proposer_skips_prompts_and_respects_max_len():
    params = SamplingParams()
    mk = lambda sid, toks, out: SequenceGroupMetadata(
        str(sid), not out, {sid: SequenceData(toks, out)}, params)
    req = ExecuteModelRequest([mk(0, [1, 2, 1], []), mk(1, [1, 2, 1], [2]), mk(2, [3] * 8, [3])],
                              num_lookahead_slots=3)
    props = NgramProposer(max_model_len=12).get_proposals(req)
    # Row 0 is a prompt; row 2 would pass the max model length (9 + 3 + 1 > 12).
    assert props.proposal_lens.tolist() == [0, 2, 0]
    assert props.proposal_token_ids[1].tolist() == [1, 2, -1]
    assert props.proposal_probs is None
