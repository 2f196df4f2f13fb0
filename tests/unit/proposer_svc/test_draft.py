"""The draft model proposer's early stop: a proposal ends after the first token the draft
is unsure of."""

from __future__ import annotations

import pytest
import torch

from specdecode.sequence import SamplingParams
from tests.support.adaptive import PROMPTS


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
    from tests.support.models import worker

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
