"""Codec between the data model (`specdecode.sequence`, `specdecode.interfaces`) and the
protobuf messages of `specdecode.v1`.

Encoding trusts its input (it is our own data). Decoding checks what must agree on the
wire (tensor byte counts, dtypes, shapes between related tensors) and raises
`InvalidRequestError` naming the offending field, e.g. `proposals.proposal_lens`; a
servicer turns that into INVALID_ARGUMENT. Semantic checks (vocabulary range, sampling
ranges) stay in `ExecuteModelRequest.validate`.

Tensors travel as raw little-endian bytes with dtype and shape (see protos/.../tensor.proto).
A None tensor is an unset message field, and an unset optional scalar is None.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from google.protobuf.message import Message

from specdecode.cost_model import ForwardCosts
from specdecode.grammar.spec import StructuredOutput
from specdecode.interfaces import SpeculativeProposals, SpeculativeScores
from specdecode.model_info import ModelInfo
from specdecode.errors import InvalidRequestError
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)
from specdecode.v1 import (model_info_pb2, sequence_pb2, speculative_pb2, structured_output_pb2,
                           tensor_pb2)

# Wire dtype -> (torch dtype, little-endian numpy dtype of the raw elements).
# bfloat16 has no numpy dtype: its 16 raw bits travel as int16.
_BY_WIRE: dict[int, tuple[torch.dtype, np.dtype]] = {
    tensor_pb2.DTYPE_FLOAT32: (torch.float32, np.dtype("<f4")),
    tensor_pb2.DTYPE_INT64: (torch.int64, np.dtype("<i8")),
    tensor_pb2.DTYPE_INT32: (torch.int32, np.dtype("<i4")),
    tensor_pb2.DTYPE_FLOAT16: (torch.float16, np.dtype("<f2")),
    tensor_pb2.DTYPE_BFLOAT16: (torch.bfloat16, np.dtype("<i2")),
}
_BY_TORCH: dict[torch.dtype, tuple[int, np.dtype]] = {
    t: (w, n) for w, (t, n) in _BY_WIRE.items()}
_INTS = (torch.int64,)
# Most elements a sparse tensor may expand to (1 GiB of float32). A dense tensor's elements
# are all in the message, so the message-size limit bounds them; a sparse one's shape is a
# claim, checked against this before anything is allocated.
MAX_DENSE_ELEMENTS = 1 << 28
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# --- tensors ------------------------------------------------------------------------------

def _raw(t: torch.Tensor, np_dtype: np.dtype) -> bytes:
    """A host tensor's elements as little-endian bytes (bfloat16 as its raw 16 bits)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().astype(np_dtype, copy=False).tobytes()  # no-op cast on little-endian


def tensor_to_proto(t: torch.Tensor, sparse: bool = False) -> tensor_pb2.Tensor:
    """Encode a tensor as raw little-endian bytes with its dtype and shape (copied to host).

    With `sparse`, rows over the last dimension are sent compressed (only nonzero elements,
    with their columns) when that is smaller than the dense buffer: probabilities under
    top-k/top-p truncation and greedy one-hot rows."""
    try:
        wire_dtype, np_dtype = _BY_TORCH[t.dtype]
    except KeyError:
        raise TypeError(f"cannot encode a {t.dtype} tensor; supported: "
                        f"{', '.join(str(d) for d in _BY_TORCH)}") from None
    host = t.detach().contiguous().cpu()
    if sparse and host.dim() >= 1 and host.numel():
        rows = host.reshape(-1, host.shape[-1])  # [R, V]
        nonzero = rows != 0
        nnz = int(nonzero.sum())
        if nnz * (np_dtype.itemsize + 4) + (rows.shape[0] + 1) * 8 < host.numel() * np_dtype.itemsize:
            starts = torch.zeros(rows.shape[0] + 1, dtype=torch.int64)
            starts[1:] = nonzero.sum(dim=1).cumsum(0)
            columns = nonzero.nonzero()[:, 1].to(torch.int32)  # row-major: grouped by row
            return tensor_pb2.Tensor(
                dtype=wire_dtype, shape=t.shape, data=_raw(rows[nonzero], np_dtype),
                sparse_rows=tensor_pb2.SparseRows(row_starts=_raw(starts, np.dtype("<i8")),
                                                  columns=_raw(columns, np.dtype("<i4"))))
    return tensor_pb2.Tensor(dtype=wire_dtype, shape=t.shape, data=_raw(host, np_dtype))


def _from_raw(data: bytes, np_dtype: np.dtype) -> torch.Tensor:
    # astype copies: the tensor owns writable, native-order memory, not the message's bytes.
    return torch.from_numpy(np.frombuffer(data, dtype=np_dtype).astype(np_dtype.newbyteorder("=")))


def _densify(m: tensor_pb2.Tensor, shape: list[int], np_dtype: np.dtype,
             field: str) -> torch.Tensor:
    """The dense elements [R, V] of a sparse Tensor, after checking its index buffers."""
    if not shape:
        raise InvalidRequestError(field, "a sparse tensor needs at least one dimension")
    R, V = math.prod(shape[:-1]), shape[-1]
    if R * V > MAX_DENSE_ELEMENTS:  # checked before anything is allocated
        raise InvalidRequestError(field, f"shape {shape} is {R * V} elements once dense; the "
                                         f"limit is {MAX_DENSE_ELEMENTS}")
    sparse = m.sparse_rows
    if len(sparse.row_starts) != (R + 1) * 8:
        raise InvalidRequestError(field, f"sparse_rows.row_starts has {len(sparse.row_starts)} "
                                         f"bytes, expected {(R + 1) * 8} for {R} rows")
    starts = _from_raw(sparse.row_starts, np.dtype("<i8"))
    nnz = len(sparse.columns) // 4
    if (len(sparse.columns) % 4 or starts[0] != 0 or starts[-1] != nnz
            or bool((starts[1:] < starts[:-1]).any())):
        raise InvalidRequestError(field, "sparse_rows.row_starts must start at 0, never "
                                         "decrease and end at the number of columns")
    if len(m.data) != nnz * np_dtype.itemsize:
        raise InvalidRequestError(field, f"{len(m.data)} data bytes for {nnz} stored elements")
    columns = _from_raw(sparse.columns, np.dtype("<i4")).long()
    if nnz and not (0 <= int(columns.min()) and int(columns.max()) < V):
        raise InvalidRequestError(field, f"sparse_rows.columns must be in [0, {V})")
    values = _from_raw(m.data, np_dtype)
    dense = torch.zeros(R, V, dtype=values.dtype)
    dense[torch.arange(R).repeat_interleave(starts.diff()), columns] = values
    return dense


def tensor_from_proto(m: tensor_pb2.Tensor, field: str) -> torch.Tensor:
    """Decode a Tensor into a new CPU tensor; InvalidRequestError(field) if it is malformed."""
    if m.dtype not in _BY_WIRE:
        name = "DTYPE_UNSPECIFIED" if m.dtype == tensor_pb2.DTYPE_UNSPECIFIED else m.dtype
        raise InvalidRequestError(field, f"unknown tensor dtype {name}")
    torch_dtype, np_dtype = _BY_WIRE[m.dtype]
    shape = list(m.shape)
    if any(d < 0 for d in shape):
        raise InvalidRequestError(field, f"negative dimension in shape {shape}")
    if m.HasField("sparse_rows"):
        t = _densify(m, shape, np_dtype, field)
    else:
        expected = math.prod(shape) * np_dtype.itemsize
        if len(m.data) != expected:
            raise InvalidRequestError(field, f"{len(m.data)} data bytes, expected {expected} "
                                             f"for shape {shape} of "
                                             f"{tensor_pb2.Dtype.Name(m.dtype)}")
        t = _from_raw(m.data, np_dtype)
    if torch_dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.reshape(shape)


def _optional_tensor(t: torch.Tensor | None, sparse: bool = False) -> tensor_pb2.Tensor | None:
    """Encode a tensor, or None for an unset field."""
    return None if t is None else tensor_to_proto(t, sparse)


def _tensor_field(m: Message, name: str, field: str, required: bool) -> torch.Tensor | None:
    """Decode the Tensor field `name` of `m`: None when unset and not required."""
    if not m.HasField(name):
        if required:
            raise InvalidRequestError(f"{field}.{name}", "is required")
        return None
    return tensor_from_proto(getattr(m, name), f"{field}.{name}")


def _check(t: torch.Tensor, field: str, dtypes: tuple[torch.dtype, ...],
           dims: Sequence[int | None], names: str) -> None:
    """Check dtype and shape; `dims` gives each dimension's size (None = any), `names` them."""
    if t.dtype not in dtypes:
        raise InvalidRequestError(
            field, f"dtype {t.dtype} not allowed here; expected {', '.join(map(str, dtypes))}")
    if t.dim() != len(dims) or any(d is not None and d != s for d, s in zip(dims, t.shape)):
        want = ", ".join(n if d is None else f"{n}={d}" for n, d in zip(names.split(), dims))
        raise InvalidRequestError(field, f"shape {list(t.shape)} does not match [{want}]")


# --- request ------------------------------------------------------------------------------

def structured_output_to_proto(so: StructuredOutput | None,
                               ) -> structured_output_pb2.StructuredOutput | None:
    """Encode a grammar (None = unset)."""
    if so is None:
        return None
    if so.kind == "choice":
        return structured_output_pb2.StructuredOutput(
            choice=structured_output_pb2.Choices(choices=so.choices))
    if so.kind == "json_object":
        return structured_output_pb2.StructuredOutput(json_object=True)
    return structured_output_pb2.StructuredOutput(**{so.kind: so.spec})


def structured_output_from_proto(m: structured_output_pb2.StructuredOutput,
                                 field: str = "structured_output") -> StructuredOutput | None:
    """Decode a grammar (no kind set = None); its spec is checked by `validate`."""
    kind = m.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(m.choice.choices))
    if kind == "json_object":
        if not m.json_object:
            raise InvalidRequestError(f"{field}.json_object", "must be true when set")
        return StructuredOutput("json_object")
    return StructuredOutput(kind, getattr(m, kind))


def sampling_params_to_proto(p: SamplingParams) -> sequence_pb2.SamplingParams:
    """Encode SamplingParams (seed None = unset)."""
    return sequence_pb2.SamplingParams(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
        max_tokens=p.max_tokens, stop_token_ids=p.stop_token_ids, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, logit_bias=p.logit_bias, logprobs=p.logprobs,
        structured_output=structured_output_to_proto(p.structured_output))


def sampling_params_from_proto(m: sequence_pb2.SamplingParams,
                               field: str = "sampling_params") -> SamplingParams:
    """Decode SamplingParams (unset seed / logprobs = None, repetition_penalty 0 = 1).
    Ranges are checked by `validate`."""
    return SamplingParams(
        temperature=m.temperature, top_k=m.top_k, top_p=m.top_p,
        seed=m.seed if m.HasField("seed") else None, max_tokens=m.max_tokens,
        stop_token_ids=tuple(m.stop_token_ids), min_p=m.min_p,
        repetition_penalty=m.repetition_penalty or 1.0, presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty, logit_bias=dict(m.logit_bias),
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        structured_output=structured_output_from_proto(m.structured_output,
                                                       f"{field}.structured_output"))


def sequence_data_to_proto(d: SequenceData) -> sequence_pb2.SequenceData:
    """Encode one sequence's token ids."""
    return sequence_pb2.SequenceData(
        prompt_token_ids=d.prompt_token_ids, output_token_ids=d.output_token_ids)


def sequence_data_from_proto(m: sequence_pb2.SequenceData) -> SequenceData:
    """Decode one sequence's token ids."""
    return SequenceData(list(m.prompt_token_ids), list(m.output_token_ids))


def sequence_group_metadata_to_proto(
        sg: SequenceGroupMetadata) -> sequence_pb2.SequenceGroupMetadata:
    """Encode one sequence group (num_speculative_tokens None = unset). `cache_id` stays
    behind: it is a scorer-internal detail of batch expansion."""
    return sequence_pb2.SequenceGroupMetadata(
        request_id=sg.request_id, is_prompt=sg.is_prompt,
        seq_data={sid: sequence_data_to_proto(d) for sid, d in sg.seq_data.items()},
        sampling_params=sampling_params_to_proto(sg.sampling_params),
        num_speculative_tokens=sg.num_speculative_tokens)


def sequence_group_metadata_from_proto(m: sequence_pb2.SequenceGroupMetadata,
                                       field: str = "seq_group_metadata",
                                       ) -> SequenceGroupMetadata:
    """Decode one sequence group; `field` is its path, for errors."""
    if not m.HasField("sampling_params"):
        raise InvalidRequestError(f"{field}.sampling_params", "is required")
    return SequenceGroupMetadata(
        request_id=m.request_id, is_prompt=m.is_prompt,
        seq_data={sid: sequence_data_from_proto(d) for sid, d in m.seq_data.items()},
        sampling_params=sampling_params_from_proto(m.sampling_params, f"{field}.sampling_params"),
        num_speculative_tokens=(m.num_speculative_tokens
                                if m.HasField("num_speculative_tokens") else None))


def request_to_proto(req: ExecuteModelRequest) -> sequence_pb2.ExecuteModelRequest:
    """Encode a step's batch."""
    return sequence_pb2.ExecuteModelRequest(
        seq_group_metadata_list=[sequence_group_metadata_to_proto(sg)
                                 for sg in req.seq_group_metadata_list],
        num_lookahead_slots=req.num_lookahead_slots, draft_ahead=req.draft_ahead)


def request_from_proto(m: sequence_pb2.ExecuteModelRequest,
                       field: str = "request") -> ExecuteModelRequest:
    """Decode a step's batch; `field` prefixes error field names. Call `validate` next."""
    return ExecuteModelRequest(
        seq_group_metadata_list=[
            sequence_group_metadata_from_proto(sg, f"{field}.seq_group_metadata_list[{i}]")
            for i, sg in enumerate(m.seq_group_metadata_list)],
        num_lookahead_slots=m.num_lookahead_slots, draft_ahead=m.draft_ahead)


# --- proposals and scores -----------------------------------------------------------------

def proposals_to_proto(p: SpeculativeProposals) -> speculative_pb2.SpeculativeProposals:
    """Encode proposals (proposal_probs None = unset)."""
    return speculative_pb2.SpeculativeProposals(
        proposal_token_ids=tensor_to_proto(p.proposal_token_ids),
        proposal_probs=_optional_tensor(p.proposal_probs, sparse=True),
        proposal_lens=tensor_to_proto(p.proposal_lens))


def proposals_from_proto(m: speculative_pb2.SpeculativeProposals, field: str = "proposals",
                         batch_size: int | None = None,
                         vocab_size: int | None = None) -> SpeculativeProposals:
    """Decode proposals, checking ids [B, k] int64, lens [B] int64 in [0, k], probs [B, k, V]
    float; with `batch_size` / `vocab_size`, also that B / V equal them (the request's
    sequence count, the model's vocabulary; V is checked before probs are decoded)."""
    ids = _tensor_field(m, "proposal_token_ids", field, required=True)
    lens = _tensor_field(m, "proposal_lens", field, required=True)
    assert ids is not None and lens is not None
    _check(ids, f"{field}.proposal_token_ids", _INTS, [batch_size, None], "B k")
    b, k = ids.shape
    _check(lens, f"{field}.proposal_lens", _INTS, [b], "B")
    if lens.numel() and not (0 <= int(lens.min()) and int(lens.max()) <= k):
        raise InvalidRequestError(f"{field}.proposal_lens",
                                  f"values must be in [0, k={k}], got {lens.tolist()}")
    if m.HasField("proposal_probs") and list(m.proposal_probs.shape) != [b, k, vocab_size] \
            and vocab_size is not None:
        raise InvalidRequestError(f"{field}.proposal_probs",
                                  f"shape {list(m.proposal_probs.shape)} does not match "
                                  f"[B={b}, k={k}, V={vocab_size}]")
    probs = _tensor_field(m, "proposal_probs", field, required=False)
    if probs is not None:
        _check(probs, f"{field}.proposal_probs", _FLOATS, [b, k, vocab_size], "B k V")
    return SpeculativeProposals(proposal_token_ids=ids, proposal_probs=probs,
                                proposal_lens=lens)


def scores_to_proto(s: SpeculativeScores) -> speculative_pb2.SpeculativeScores:
    """Encode scores (probs / logprobs None = unset)."""
    return speculative_pb2.SpeculativeScores(
        probs=_optional_tensor(s.probs, sparse=True),
        logprobs=_optional_tensor(s.logprobs, sparse=True),
        token_ids=tensor_to_proto(s.token_ids))


def scores_from_proto(m: speculative_pb2.SpeculativeScores, field: str = "scores",
                      batch_size: int | None = None,
                      num_positions: int | None = None) -> SpeculativeScores:
    """Decode scores, checking token_ids [B, k+1] int64 and probs / logprobs [B, k+1, V]
    float with one V; with `batch_size` / `num_positions` (k+1), also B / k+1."""
    token_ids = _tensor_field(m, "token_ids", field, required=True)
    probs = _tensor_field(m, "probs", field, required=False)
    logprobs = _tensor_field(m, "logprobs", field, required=False)
    assert token_ids is not None
    _check(token_ids, f"{field}.token_ids", _INTS, [batch_size, num_positions], "B k+1")
    b, positions = token_ids.shape
    vocab: int | None = None
    for name, t in (("probs", probs), ("logprobs", logprobs)):
        if t is not None:
            _check(t, f"{field}.{name}", _FLOATS, [b, positions, vocab], "B k+1 V")
            vocab = t.shape[2]
    return SpeculativeScores(probs=probs, logprobs=logprobs, token_ids=token_ids)


def model_info_to_proto(info: ModelInfo) -> model_info_pb2.ModelInfo:
    fields = {k: v for k, v in vars(info).items() if k != "forward_cost"}
    m = model_info_pb2.ModelInfo(**fields)
    if info.forward_cost is not None:
        costs = info.forward_cost.snapshot()
        m.forward_cost.rows[:] = costs.rows
        m.forward_cost.tokens[:] = costs.tokens
        m.forward_cost.seconds[:] = [s for line in costs.seconds for s in line]
        m.forward_cost.version = costs.version
    return m


def model_info_from_proto(m: model_info_pb2.ModelInfo) -> ModelInfo:
    """InvalidRequestError (naming the field) when forward_cost's sizes disagree."""
    fields = {f: getattr(m, f) for f in ModelInfo.__dataclass_fields__ if f != "forward_cost"}
    fields["cpus"] = tuple(m.cpus)
    costs = None
    if m.HasField("forward_cost"):
        c = m.forward_cost
        rows, tokens, seconds = list(c.rows), list(c.tokens), list(c.seconds)
        if not rows or not tokens or len(seconds) != len(rows) * len(tokens):
            raise InvalidRequestError("forward_cost", f"{len(seconds)} seconds for "
                                      f"{len(rows)} rows x {len(tokens)} tokens")
        costs = ForwardCosts(rows, tokens, [seconds[i * len(tokens):(i + 1) * len(tokens)]
                                            for i in range(len(rows))], c.version)
    return ModelInfo(**fields, forward_cost=costs)
