"""What a service checks in a peer's step before any tensor op (issue 25): proposals against
the request (SpeculativeProposals.validate), sequence ids and sampling values that would
overflow (ExecuteModelRequest.validate), each failure naming its field."""

from __future__ import annotations

import pytest
import torch

from specdecode.interfaces import SpeculativeProposals
from specdecode.sampling import TokenHistory, sample_logits, truncated_probs
from specdecode.sequence import (MIN_REPETITION_PENALTY, MIN_TEMPERATURE, ExecuteModelRequest,
                                 InvalidRequestError, SamplingParams, SequenceData,
                                 SequenceGroupMetadata, fields_of)

V, MAX_LEN = 16, 32


def step(k: int = 2, lengths=(3, 5), temperatures=(0.0, 0.8)) -> ExecuteModelRequest:
    return ExecuteModelRequest([SequenceGroupMetadata(
        f"r{i}", False, {10 + i: SequenceData(list(range(1, n)), [1])},
        SamplingParams(temperature=t)) for i, (n, t) in enumerate(zip(lengths, temperatures))], k)


def proposals(ids, lens, probs=None) -> SpeculativeProposals:
    return SpeculativeProposals(torch.tensor(ids), probs, torch.tensor(lens))


def normalised_probs(B: int = 2, k: int = 2) -> torch.Tensor:
    return torch.softmax(torch.randn(B, k, V, generator=torch.Generator().manual_seed(0)), -1)


def test_valid_proposals_pass():
    proposals([[3, 4], [5, -1]], [2, 1], normalised_probs()).validate(step(), V, MAX_LEN)
    proposals([[-1, -1], [-1, -1]], [0, 0]).validate(step(), V, MAX_LEN)


@pytest.mark.parametrize("ids,lens,field,text", [
    ([[-1, 4], [5, -1]], [2, 1], "proposal_token_ids", "[0, 0] is -1"),  # the marker inside
    ([[3, V], [5, -1]], [2, 1], "proposal_token_ids", f"[0, 1] is {V}"),
    ([[3, 4], [5, 7]], [2, 1], "proposal_token_ids", "[1, 1] is 7: within proposal_lens[1] = 1"),
    ([[3, 4], [5, -2]], [2, 1], "proposal_token_ids", "[1, 1] is -2"),
    ([[3, 4, 5], [5, -1, -1]], [2, 1], "proposal_token_ids", "has 3 columns"),
])
def test_bad_proposal_ids_name_the_field(ids, lens, field, text):
    with pytest.raises(InvalidRequestError) as e:
        proposals(ids, lens).validate(step(), V, MAX_LEN)
    assert e.value.field == field and text in e.value.detail, e.value


def test_a_proposal_that_passes_the_model_length_is_refused():
    req = step(lengths=(MAX_LEN - 2, 3))  # 30 tokens (with one output): 2 more fit
    proposals([[3, 4], [5, -1]], [2, 1]).validate(req, V, MAX_LEN)
    req = step(lengths=(MAX_LEN - 1, 3))
    with pytest.raises(InvalidRequestError) as e:
        proposals([[3, 4], [5, -1]], [2, 1]).validate(req, V, MAX_LEN)
    assert e.value.field == "proposal_lens" and "[0] = 2" in e.value.detail


@pytest.mark.parametrize("corrupt,text", [
    (lambda p: p.view(-1).__setitem__(7, float("nan")), "finite"),
    (lambda p: p.view(-1).__setitem__(7, float("inf")), "finite"),
    (lambda p: p.view(-1).__setitem__(7, -0.25), "in [0, 1]"),
    (lambda p: p.view(-1).__setitem__(7, 1.5), "in [0, 1]"),
    (lambda p: p[1, 0].mul_(0.5), "[1, 0] sums to 0.5"),  # the sampled sequence's row
])
def test_bad_draft_probabilities_name_the_field(corrupt, text):
    probs = normalised_probs()
    corrupt(probs)
    with pytest.raises(InvalidRequestError) as e:
        proposals([[3, 4], [5, -1]], [2, 1], probs).validate(step(), V, MAX_LEN)
    assert e.value.field == "proposal_probs" and text in e.value.detail, e.value


def test_rows_nobody_samples_may_be_unnormalised():
    """Greedy sequences' rows and rows beyond a proposal's length may be all zero."""
    probs = normalised_probs()
    probs[0] = 0.0  # greedy sequence
    probs[1, 1] = 0.0  # beyond proposal_lens[1] = 1
    proposals([[3, 4], [5, -1]], [2, 1], probs).validate(step(), V, MAX_LEN)


@pytest.mark.parametrize("edit,field", [
    (lambda r: r.seq_group_metadata_list[1].seq_data.update({-1: r.seq_group_metadata_list[1].
                                                             seq_data.pop(11)}),
     "seq_group_metadata_list[1].seq_data"),
    (lambda r: r.seq_group_metadata_list[1].seq_data.update({10: r.seq_group_metadata_list[1].
                                                             seq_data.pop(11)}),
     "seq_group_metadata_list[1].seq_data"),  # the id of sequence 0 again
    (lambda r: setattr(r.seq_group_metadata_list[0], "num_speculative_tokens", -1),
     "seq_group_metadata_list[0].num_speculative_tokens"),
    (lambda r: setattr(r.seq_group_metadata_list[1].sampling_params, "temperature", 1e-40),
     "seq_group_metadata_list[1].sampling_params.temperature"),
    (lambda r: setattr(r.seq_group_metadata_list[1].sampling_params, "temperature",
                       float("inf")), "seq_group_metadata_list[1].sampling_params.temperature"),
    (lambda r: setattr(r.seq_group_metadata_list[0].sampling_params, "repetition_penalty",
                       1e-30), "seq_group_metadata_list[0].sampling_params.repetition_penalty"),
])
def test_bad_step_fields_name_the_field(edit, field):
    req = step()
    edit(req)
    with pytest.raises(InvalidRequestError) as e:
        req.validate(V, MAX_LEN)
    assert e.value.field == field, e.value


def test_the_smallest_allowed_values_sample_finite_distributions():
    """Why the bounds: below them a sampled row overflows to NaN and its draw fails; at them
    (every token seen, so the penalty applies everywhere) it stays a distribution."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1)) * 30  # [1, V]
    params = SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=MIN_REPETITION_PENALTY)
    params.validate(V)
    out = sample_logits(logits, [params], [0], "target", True, False,
                        [TokenHistory(list(range(V)), 0)])
    assert torch.isfinite(out.sampled_token_probs).all()
    with pytest.raises(RuntimeError, match="probability tensor"):
        sample_logits(logits, [SamplingParams(temperature=1e-40)], [0], "target", True, False)


def test_fields_of_prefixes_the_field():
    with pytest.raises(InvalidRequestError) as e, fields_of("request"):
        raise InvalidRequestError("num_lookahead_slots", "must be >= 0")
    assert (e.value.field, str(e.value)) == ("request.num_lookahead_slots",
                                             "request.num_lookahead_slots: must be >= 0")


def test_a_top_p_below_float32s_range_keeps_the_top_token():
    """top_p = 1e-60 is in (0, 1] but 0 in float32: the nucleus is still the top token."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2))  # [2, V]
    params = SamplingParams(temperature=0.8, top_p=1e-60)
    params.validate(V)
    probs = truncated_probs(logits, params)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())
