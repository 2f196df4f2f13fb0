"""The codec between the data model and specdecode.v1 protobuf (specdecode/wire/codec.py)."""

from __future__ import annotations

import pytest
import torch

from specdecode.wire import codec
from specdecode.interfaces import SpeculativeProposals, SpeculativeScores
from specdecode.errors import InvalidRequestError
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData, SequenceGroupMetadata)
from specdecode.v1 import (proposer_service_pb2, scorer_service_pb2, sequence_pb2,
                           speculative_pb2, tensor_pb2)
from tests.support.paths import ROOT

DTYPES = [torch.float32, torch.int64, torch.bfloat16, torch.float16, torch.int32]


def roundtrip(t: torch.Tensor) -> torch.Tensor:
    """Encode, serialize, parse and decode a tensor."""
    wire_msg = tensor_pb2.Tensor.FromString(codec.tensor_to_proto(t).SerializeToString())
    return codec.tensor_from_proto(wire_msg, "t")


def assert_same(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    """Equal dtype, shape and bits (so NaN, -inf and -0.0 count)."""
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.numel():
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 4, 5), (7,), (), (0,), (2, 0, 3)], ids=str)
def test_tensor_roundtrip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g) * 1000).to(dtype)
    if dtype.is_floating_point and t.numel() >= 3:
        t.view(-1)[:3] = torch.tensor([float("nan"), float("-inf"), -0.0])
    back = roundtrip(t)
    assert_same(t, back)
    back.add_(1)  # decoded tensors own writable memory


def test_tensor_bytes_are_little_endian_and_bfloat16_raw_bits() -> None:
    m = codec.tensor_to_proto(torch.tensor([1, 256], dtype=torch.int32))
    assert m.dtype == tensor_pb2.DTYPE_INT32 and list(m.shape) == [2]
    assert m.data == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    m = codec.tensor_to_proto(torch.tensor([1.0], dtype=torch.bfloat16))
    assert m.dtype == tensor_pb2.DTYPE_BFLOAT16 and m.data == b"\x80\x3f"  # 0x3f80


def test_non_contiguous_tensor_is_sent_in_logical_order() -> None:
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()
    assert_same(roundtrip(t), t.contiguous())


def test_unsupported_dtype_is_refused_when_encoding() -> None:
    with pytest.raises(TypeError, match="bool"):
        codec.tensor_to_proto(torch.zeros(2, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [tensor_pb2.DTYPE_UNSPECIFIED, 99])
def test_unknown_dtype_names_the_field(dtype: int) -> None:
    m = tensor_pb2.Tensor(dtype=dtype, shape=[2], data=b"\0" * 8)
    with pytest.raises(InvalidRequestError, match="dtype") as e:
        codec.tensor_from_proto(m, "proposals.proposal_probs")
    assert e.value.field == "proposals.proposal_probs"


@pytest.mark.parametrize("cut", [1, 4, -3])
def test_corrupted_bytes_name_the_field(cut: int) -> None:
    m = codec.tensor_to_proto(torch.ones(2, 3))
    m.data = m.data[:-cut] if cut > 0 else m.data + b"\0" * -cut
    with pytest.raises(InvalidRequestError, match="bytes") as e:
        codec.tensor_from_proto(m, "scores.probs")
    assert e.value.field == "scores.probs"
    assert str(e.value).startswith("scores.probs: ")


def test_negative_dimension_names_the_field() -> None:
    m = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64, shape=[-1, -8], data=b"\0" * 64)
    with pytest.raises(InvalidRequestError, match="negative") as e:
        codec.tensor_from_proto(m, "x")
    assert e.value.field == "x"


def test_float32_block_travels_as_raw_bytes() -> None:
    t = torch.rand(8, 5, 1000)
    m = codec.tensor_to_proto(t)
    assert len(m.data) == 8 * 5 * 1000 * 4
    assert 160_000 < m.ByteSize() < 160_000 + 32


# --- request ------------------------------------------------------------------------------

def make_request() -> ExecuteModelRequest:
    """Three groups covering every optional field set and unset."""
    groups = [
        SequenceGroupMetadata(
            request_id="req-0", is_prompt=True, seq_data={0: SequenceData([1, 2, 3])},
            sampling_params=SamplingParams()),
        SequenceGroupMetadata(
            request_id="req-1", is_prompt=False,
            seq_data={7: SequenceData([5, 6], [9, 10, 11])},
            sampling_params=SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=-12345,
                                           max_tokens=128, stop_token_ids=(2, 0)),
            num_speculative_tokens=0),
        SequenceGroupMetadata(
            request_id="", is_prompt=False, seq_data={2**40: SequenceData([0], [151_935])},
            sampling_params=SamplingParams(temperature=1e-3, seed=0),
            num_speculative_tokens=5),
    ]
    return ExecuteModelRequest(groups, num_lookahead_slots=4)


def test_request_roundtrip() -> None:
    req = make_request()
    m = codec.request_to_proto(req)
    back = codec.request_from_proto(type(m).FromString(m.SerializeToString()))
    assert back == req
    assert back.seq_group_metadata_list[1].sampling_params.stop_token_ids == (2, 0)
    assert back.seq_group_metadata_list[0].sampling_params.seed is None
    assert back.seq_group_metadata_list[1].num_speculative_tokens == 0  # 0 is not "unset"


def test_request_optional_fields_are_unset_on_the_wire() -> None:
    g0, g1, g2 = codec.request_to_proto(make_request()).seq_group_metadata_list
    assert not g0.HasField("num_speculative_tokens")
    assert not g0.sampling_params.HasField("seed")
    assert g1.HasField("num_speculative_tokens") and g1.num_speculative_tokens == 0
    assert g2.sampling_params.HasField("seed") and g2.sampling_params.seed == 0


def test_derived_and_internal_fields_stay_off_the_wire() -> None:
    """cache_id is the scorer's own (batch expansion); want_probs / want_logprobs follow
    from the sampling params the request already carries."""
    group = make_request().seq_group_metadata_list[1]
    expanded = group.with_appended([4], seq_id=99, cache_id=7)
    back = codec.sequence_group_metadata_from_proto(
        codec.sequence_group_metadata_to_proto(expanded))
    assert expanded.kv_cache_id == 7 and back.kv_cache_id == 99
    fields = {m: {f.name for f in m.DESCRIPTOR.fields} for m in (
        sequence_pb2.SequenceGroupMetadata, proposer_service_pb2.GetProposalsRequest,
        scorer_service_pb2.ScoreProposalsRequest)}
    assert not {"cache_id", "want_probs", "want_logprobs"} & set().union(*fields.values())


def test_several_sequences_in_one_group_survive_for_validate_to_reject() -> None:
    req = make_request()
    req.seq_group_metadata_list[0].seq_data[1] = SequenceData([4])
    back = codec.request_from_proto(codec.request_to_proto(req))
    assert back == req
    with pytest.raises(InvalidRequestError) as e:
        back.validate(vocab_size=200_000, max_model_len=1000)
    assert e.value.field == "seq_group_metadata_list[0].seq_data"


def test_missing_sampling_params_names_the_field() -> None:
    m = codec.request_to_proto(make_request())
    m.seq_group_metadata_list[1].ClearField("sampling_params")
    with pytest.raises(InvalidRequestError) as e:
        codec.request_from_proto(m)
    assert e.value.field == "request.seq_group_metadata_list[1].sampling_params"


def test_empty_request_roundtrip() -> None:
    req = ExecuteModelRequest([])
    assert codec.request_from_proto(codec.request_to_proto(req)) == req


# --- proposals and scores -----------------------------------------------------------------

def make_proposals(with_probs: bool) -> SpeculativeProposals:
    ids = torch.tensor([[4, 5, 6], [7, -1, -1], [-1, -1, -1]])
    probs = torch.softmax(torch.randn(3, 3, 11), dim=-1) if with_probs else None
    return SpeculativeProposals(ids, probs, torch.tensor([3, 1, 0]))


def make_scores(with_probs: bool, with_logprobs: bool) -> SpeculativeScores:
    probs = torch.softmax(torch.randn(3, 4, 11), dim=-1)
    logprobs = probs.log()
    logprobs[2, 1:] = float("-inf")
    return SpeculativeScores(probs if with_probs else None,
                             logprobs if with_logprobs else None,
                             torch.tensor([[1, 2, 3, 4], [5, 6, -1, -1], [8, -1, -1, -1]]))


def assert_proposals_equal(a: SpeculativeProposals, b: SpeculativeProposals) -> None:
    assert_same(a.proposal_token_ids, b.proposal_token_ids)
    assert_same(a.proposal_probs, b.proposal_probs)
    assert_same(a.proposal_lens, b.proposal_lens)


@pytest.mark.parametrize("with_probs", [True, False])
def test_proposals_roundtrip(with_probs: bool) -> None:
    p = make_proposals(with_probs)
    m = codec.proposals_to_proto(p)
    assert m.HasField("proposal_probs") == with_probs
    back = codec.proposals_from_proto(
        speculative_pb2.SpeculativeProposals.FromString(m.SerializeToString()), batch_size=3)
    assert_proposals_equal(p, back)


@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("with_logprobs", [True, False])
def test_scores_roundtrip(with_probs: bool, with_logprobs: bool) -> None:
    s = make_scores(with_probs, with_logprobs)
    m = codec.scores_to_proto(s)
    assert m.HasField("probs") == with_probs and m.HasField("logprobs") == with_logprobs
    back = codec.scores_from_proto(
        speculative_pb2.SpeculativeScores.FromString(m.SerializeToString()),
        batch_size=3, num_positions=4)
    assert_same(s.probs, back.probs)
    assert_same(s.logprobs, back.logprobs)
    assert_same(s.token_ids, back.token_ids)


def test_empty_batch_roundtrips() -> None:
    p = SpeculativeProposals(torch.zeros(0, 0, dtype=torch.long), None,
                             torch.zeros(0, dtype=torch.long))
    assert_proposals_equal(p, codec.proposals_from_proto(codec.proposals_to_proto(p)))
    s = SpeculativeScores(torch.zeros(0, 1, 7), None, torch.zeros(0, 1, dtype=torch.long))
    back = codec.scores_from_proto(codec.scores_to_proto(s))
    assert_same(s.probs, back.probs)
    assert_same(s.token_ids, back.token_ids)


def test_rpc_messages_carry_the_codec_output() -> None:
    req, p = make_request(), make_proposals(True)
    msg = scorer_service_pb2.ScoreProposalsRequest(
        request=codec.request_to_proto(req), proposals=codec.proposals_to_proto(p))
    parsed = scorer_service_pb2.ScoreProposalsRequest.FromString(msg.SerializeToString())
    assert codec.request_from_proto(parsed.request) == req
    assert_proposals_equal(p, codec.proposals_from_proto(parsed.proposals, batch_size=3))


def _bad_proposals(case: str) -> tuple[speculative_pb2.SpeculativeProposals, str]:
    m = codec.proposals_to_proto(make_proposals(True))
    t = codec.tensor_to_proto
    if case == "ids missing":
        m.ClearField("proposal_token_ids")
        return m, "proposals.proposal_token_ids"
    if case == "lens missing":
        m.ClearField("proposal_lens")
        return m, "proposals.proposal_lens"
    if case == "ids 1-d":
        m.proposal_token_ids.CopyFrom(t(torch.tensor([1, 2, 3])))
        return m, "proposals.proposal_token_ids"
    if case == "ids float":
        m.proposal_token_ids.CopyFrom(t(torch.zeros(3, 3)))
        return m, "proposals.proposal_token_ids"
    if case == "lens batch":
        m.proposal_lens.CopyFrom(t(torch.tensor([3, 1])))
        return m, "proposals.proposal_lens"
    if case == "lens int32":
        m.proposal_lens.CopyFrom(t(torch.tensor([3, 1, 0], dtype=torch.int32)))
        return m, "proposals.proposal_lens"
    if case == "lens over k":
        m.proposal_lens.CopyFrom(t(torch.tensor([3, 4, 0])))
        return m, "proposals.proposal_lens"
    if case == "lens negative":
        m.proposal_lens.CopyFrom(t(torch.tensor([3, -1, 0])))
        return m, "proposals.proposal_lens"
    if case == "probs k":
        m.proposal_probs.CopyFrom(t(torch.zeros(3, 2, 11)))
        return m, "proposals.proposal_probs"
    if case == "probs int":
        m.proposal_probs.CopyFrom(t(torch.zeros(3, 3, 11, dtype=torch.long)))
        return m, "proposals.proposal_probs"
    if case == "probs bytes":
        m.proposal_probs.data = m.proposal_probs.data[:-1]
        return m, "proposals.proposal_probs"
    raise AssertionError(case)


@pytest.mark.parametrize("case", [
    "ids missing", "lens missing", "ids 1-d", "ids float", "lens batch", "lens int32",
    "lens over k", "lens negative", "probs k", "probs int", "probs bytes"])
def test_bad_proposals_name_the_field(case: str) -> None:
    m, field = _bad_proposals(case)
    with pytest.raises(InvalidRequestError) as e:
        codec.proposals_from_proto(m)
    assert e.value.field == field, str(e.value)


def test_proposals_batch_size_must_match_the_request() -> None:
    m = codec.proposals_to_proto(make_proposals(False))
    with pytest.raises(InvalidRequestError, match="B=4") as e:
        codec.proposals_from_proto(m, batch_size=4)
    assert e.value.field == "proposals.proposal_token_ids"


@pytest.mark.parametrize("case,field", [
    ("token_ids missing", "scores.token_ids"),
    ("positions", "scores.token_ids"),
    ("probs batch", "scores.probs"),
    ("logprobs vocab", "scores.logprobs"),
    ("logprobs dtype", "scores.logprobs"),
])
def test_bad_scores_name_the_field(case: str, field: str) -> None:
    m = codec.scores_to_proto(make_scores(True, True))
    if case == "token_ids missing":
        m.ClearField("token_ids")
    elif case == "probs batch":
        m.probs.CopyFrom(codec.tensor_to_proto(torch.zeros(2, 4, 11)))
    elif case == "logprobs vocab":
        m.logprobs.CopyFrom(codec.tensor_to_proto(torch.zeros(3, 4, 12)))
    elif case == "logprobs dtype":
        m.logprobs.CopyFrom(codec.tensor_to_proto(torch.zeros(3, 4, 11, dtype=torch.int32)))
    with pytest.raises(InvalidRequestError) as e:
        codec.scores_from_proto(m, batch_size=3, num_positions=5 if case == "positions" else 4)
    assert e.value.field == field, str(e.value)


def test_bfloat16_probs_are_accepted() -> None:
    p = make_proposals(True)
    p.proposal_probs = p.proposal_probs.to(torch.bfloat16)
    assert_proposals_equal(p, codec.proposals_from_proto(codec.proposals_to_proto(p)))


def test_a_step_costs_its_raw_tensor_bytes() -> None:
    s = make_scores(True, False)
    m = codec.scores_to_proto(s)
    raw = s.probs.numel() * 4 + s.token_ids.numel() * 8
    assert raw < m.ByteSize() < raw + 64


# --- sparse probability rows -----------------------------------------------------------------

def truncated(shape: tuple[int, ...], keep: int, seed: int = 0) -> torch.Tensor:
    """Probabilities with `keep` nonzero entries per row, as top-k truncation leaves them."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=gen)
    kth = logits.topk(keep, dim=-1).values[..., -1:]
    return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_truncated_probs_travel_sparse_and_roundtrip(dtype) -> None:
    probs = truncated((8, 5, 49152), keep=50).to(dtype)
    m = codec.tensor_to_proto(probs, sparse=True)
    assert m.HasField("sparse_rows")
    dense_bytes = probs.numel() * probs.element_size()
    assert m.ByteSize() < 0.01 * dense_bytes  # 40 rows x 50 entries, not 40 x 49152
    assert torch.equal(codec.tensor_from_proto(m, "probs"), probs)


def test_one_hot_rows_travel_sparse_and_dense_rows_stay_dense() -> None:
    one_hot = torch.nn.functional.one_hot(torch.tensor([[3, 7], [0, 9]]), 10).float()
    m = codec.tensor_to_proto(one_hot, sparse=True)
    assert m.HasField("sparse_rows")
    assert torch.equal(codec.tensor_from_proto(m, "probs"), one_hot)
    full = torch.softmax(torch.randn(2, 3, 10), dim=-1)  # no zeros: sparse would be larger
    assert not codec.tensor_to_proto(full, sparse=True).HasField("sparse_rows")
    assert not codec.tensor_to_proto(one_hot).HasField("sparse_rows")  # only when asked


def test_proposal_and_target_probs_are_sent_sparse_logprobs_dense() -> None:
    probs = truncated((2, 3, 500), keep=5)
    props = SpeculativeProposals(torch.zeros(2, 2, dtype=torch.long), probs[:, :2],
                                 torch.tensor([2, 2]))
    assert codec.proposals_to_proto(props).proposal_probs.HasField("sparse_rows")
    scores = SpeculativeScores(probs, torch.log(probs), torch.zeros(2, 3, dtype=torch.long))
    m = codec.scores_to_proto(scores)
    assert m.probs.HasField("sparse_rows") and not m.logprobs.HasField("sparse_rows")
    back = codec.scores_from_proto(m)
    assert torch.equal(back.probs, probs) and torch.equal(back.logprobs, torch.log(probs))


@pytest.mark.parametrize("corrupt,message", [
    (lambda m: setattr(m.sparse_rows, "row_starts", m.sparse_rows.row_starts[:-8]), "row_starts"),
    (lambda m: setattr(m.sparse_rows, "row_starts",
                       torch.tensor([0, 2, 1, 3, 3], dtype=torch.int64).numpy().tobytes()),
     "never decrease"),
    (lambda m: setattr(m.sparse_rows, "columns",
                       torch.tensor([0, 1, 99], dtype=torch.int32).numpy().tobytes()),
     "columns must be in"),
    (lambda m: setattr(m, "data", m.data[:-4]), "data bytes"),
])
def test_malformed_sparse_rows_name_the_field(corrupt, message) -> None:
    probs = torch.zeros(4, 10)
    probs[0, 1], probs[1, 2], probs[2, 3] = 1.0, 1.0, 1.0  # rows 0-2 one-hot, row 3 empty
    m = codec.tensor_to_proto(probs, sparse=True)
    assert m.HasField("sparse_rows")
    corrupt(m)
    with pytest.raises(InvalidRequestError, match=message) as err:
        codec.tensor_from_proto(m, "scores.probs")
    assert err.value.field == "scores.probs"


def test_finish_reasons_and_usage_convert_in_one_place_each():
    """Every finish reason and every usage count survives the wire; the enum and the Usage
    message are spelled out only in specdecode/api/finish_reason.py and specdecode/api/usage.py."""
    import re

    from specdecode.api import finish_reason
    from specdecode.api.usage import Usage, openai_usage, usage_from_proto, usage_to_proto
    for name in ("stop", "length", "cancelled"):
        assert finish_reason.from_proto(finish_reason.to_proto(name)) == name
    assert finish_reason.from_proto(99) == "unknown"
    assert [finish_reason.to_openai(r) for r in ("stop", "length", "cancelled", None)] == \
        ["stop", "length", "abort", None]
    usage = Usage(prompt_tokens=5, completion_tokens=7, draft_tokens=8, accepted_tokens=4,
                  emitted_tokens=6, steps=3)
    message = usage_to_proto(usage)
    assert message.acceptance_rate == 0.5 and usage_from_proto(message) == usage
    assert openai_usage(usage)["total_tokens"] == 12
    assert openai_usage(usage)["speculative"]["acceptance_rate"] == 0.5
    root = ROOT
    homes = {r'FINISH_REASON_|"abort"': "specdecode/api/finish_reason.py",
             r'pb\.Usage\(|Usage\(prompt_tokens=\w+\.prompt_tokens|"total_tokens"':
             "specdecode/api/usage.py"}
    for pattern, home in homes.items():
        found = {str(p.relative_to(root)) for folder in ("orchestrator", "specdecode",
                                                           "specdecode_stack")
                 for p in (root / folder).rglob("*.py")
                 if "/v1/" not in str(p) and re.search(pattern, p.read_text())}
        assert found == {home}, pattern
