"""Messages a peer must not send, for every method of the proposer and the scorer (issue 25):
structured out-of-range values (a valid message with one to three fields set to values the
contract forbids: ids outside the vocabulary, the -1 padding marker inside a proposal's
length, NaN probabilities, lengths that disagree with k or the batch, ...) and byte mutations
of valid and structured messages. `fuzz` sends them and counts the status codes."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import torch
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from specdecode.wire import codec
from specdecode.v1 import (model_info_pb2, proposer_service_pb2, scorer_service_pb2,
                           sequence_pb2, speculative_pb2, tensor_pb2)

VOCAB, MAX_LEN = 256, 256  # the tiny test models' (specdecode.models.tiny_models.TinyModelSpec)
NAN, INF = math.nan, math.inf
BAD_IDS = [-1, -2, VOCAB, VOCAB + 1, 2**31, 2**62, 2**63 - 1, -2**63]
BAD_FLOATS = [NAN, INF, -INF, -1.0, 0.0, 5e-324, 1e-40, 1e-30, 1e308, 1.5, 3.0, 200.0]
BAD_INT32 = [-1, -2**31, 2**31 - 1, 0, 17, 21, 300]
BAD_DIMS = [-1, 0, 2, 7, 2**20, 2**40, 2**63 - 1]
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")
# What a peer's bad message may get back: anything but a failure of the service itself.
FAILURES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.DEADLINE_EXCEEDED}

Edit = Callable[[random.Random, Message], None]


# -- valid messages --------------------------------------------------------------------------

def step_request(rng: random.Random) -> sequence_pb2.ExecuteModelRequest:
    """A valid step: 1-3 sequences, greedy or sampled, k in [0, 4]."""
    m = sequence_pb2.ExecuteModelRequest(num_lookahead_slots=rng.randrange(5))
    for i in range(rng.randrange(1, 4)):
        sg = m.seq_group_metadata_list.add(request_id=f"r{i}")
        data = sg.seq_data[rng.randrange(2**40)]
        data.prompt_token_ids[:] = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        data.output_token_ids[:] = [rng.randrange(VOCAB) for _ in range(rng.randrange(4))]
        sg.is_prompt = not data.output_token_ids
        p = sg.sampling_params
        p.max_tokens, p.top_p = 8, 1.0
        if rng.random() < 0.5:
            p.temperature, p.top_k, p.seed = 0.8, rng.choice([0, 5, 50]), rng.randrange(99)
    return m


def proposals_for(rng: random.Random, m: sequence_pb2.ExecuteModelRequest,
                  with_probs: bool = False) -> tuple:
    """Valid (ids [B, k] -1 padded, lens [B], probs [B, k, V] or None) for step `m`."""
    B, k = len(m.seq_group_metadata_list), m.num_lookahead_slots
    lens = torch.tensor([rng.randrange(k + 1) for _ in range(B)], dtype=torch.long)
    ids = torch.full((B, k), -1, dtype=torch.long)
    probs = torch.zeros(B, k, VOCAB) if with_probs else None
    for i, n in enumerate(lens.tolist()):
        ids[i, :n] = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(i))
        if probs is not None:
            probs[i, :n] = torch.softmax(torch.randn(n, VOCAB), -1)
    return ids, lens, probs


def score_request(rng: random.Random) -> scorer_service_pb2.ScoreProposalsRequest:
    m = step_request(rng)
    ids, lens, probs = proposals_for(rng, m, with_probs=rng.random() < 0.3)
    return scorer_service_pb2.ScoreProposalsRequest(
        request=m, proposals=speculative_pb2.SpeculativeProposals(
            proposal_token_ids=codec.tensor_to_proto(ids),
            proposal_lens=codec.tensor_to_proto(lens),
            proposal_probs=None if probs is None else codec.tensor_to_proto(probs, sparse=True)))


# -- structured edits of a step request ------------------------------------------------------

def _group(rng, m: sequence_pb2.ExecuteModelRequest) -> sequence_pb2.SequenceGroupMetadata:
    """A random group of the batch (a new one when an earlier edit emptied it)."""
    if not m.seq_group_metadata_list:
        m.seq_group_metadata_list.add().sampling_params.max_tokens = 4
    return rng.choice(m.seq_group_metadata_list)


def _data(rng, m) -> sequence_pb2.SequenceData:
    """A random group's sequence (a new one when an earlier edit emptied it)."""
    sg = _group(rng, m)
    if not sg.seq_data:
        sg.seq_data[rng.randrange(2**40)].prompt_token_ids[:] = [5, 6]
    return next(iter(sg.seq_data.values()))


def edit_lookahead(rng, m):
    m.num_lookahead_slots = rng.choice(BAD_INT32)


def edit_seq_id(rng, m):
    sg = _group(rng, m)
    if not sg.seq_data:
        return
    old, data = next(iter(sg.seq_data.items()))
    new = rng.choice([-1, -2**63, 2**63 - 1, 2**62, *m.seq_group_metadata_list[0].seq_data])
    kept = sequence_pb2.SequenceData()
    kept.CopyFrom(data)
    del sg.seq_data[old]
    sg.seq_data[new].CopyFrom(kept)


def edit_token_ids(rng, m):
    data = _data(rng, m)
    ids = data.prompt_token_ids if rng.random() < 0.6 else data.output_token_ids
    ids.insert(rng.randrange(len(ids) + 1), rng.choice(BAD_IDS))


def edit_lengths(rng, m):
    data = _data(rng, m)
    choice = rng.randrange(3)
    if choice == 0:
        del data.prompt_token_ids[:]
    elif choice == 1:  # at or near the model's length, with k on top
        data.prompt_token_ids[:] = [1] * (MAX_LEN - rng.randrange(6))
    else:
        data.output_token_ids[:] = [2] * rng.randrange(MAX_LEN - 8, MAX_LEN + 2)


def edit_seq_data(rng, m):
    sg = _group(rng, m)
    if rng.random() < 0.5:
        sg.seq_data.clear()
    else:
        sg.seq_data[rng.randrange(2**40)].prompt_token_ids[:] = [3, 4]


def edit_sampling(rng, m):
    p = _group(rng, m).sampling_params
    if rng.random() < 0.4:
        p.temperature = 0.7  # the sampled path, with the bad value below
    choice = rng.randrange(8)
    if choice < 3:
        setattr(p, rng.choice(FLOAT_FIELDS), rng.choice(BAD_FLOATS))
    elif choice == 3:
        p.top_k = rng.choice(BAD_INT32)
    elif choice == 4:
        p.logit_bias[rng.choice([0, *BAD_IDS])] = rng.choice([1.0, *BAD_FLOATS])
    elif choice == 5:
        p.logprobs = rng.choice(BAD_INT32)
    elif choice == 6:
        p.max_tokens = rng.choice(BAD_INT32)
    else:
        p.stop_token_ids.append(rng.choice(BAD_IDS))


def edit_group(rng, m):
    sg = _group(rng, m)
    choice = rng.randrange(4)
    if choice == 0:
        sg.ClearField("sampling_params")
    elif choice == 1:
        sg.num_speculative_tokens = rng.choice(BAD_INT32)
    elif choice == 2:
        sg.is_prompt = not sg.is_prompt
    else:
        sg.request_id = "x" * rng.choice([0, 10_000])


def edit_prefix(rng, m):
    """The delta form with a prefix this service may or may not hold."""
    data = _data(rng, m)
    data.prefix.length = rng.choice([-1, 0, 1, 3, 2**31, 2**63 - 1])
    data.prefix.hash = rng.randrange(2**64)


def edit_batch(rng, m):
    if rng.random() < 0.5:
        del m.seq_group_metadata_list[:]
    else:
        m.seq_group_metadata_list.append(m.seq_group_metadata_list[0])  # a duplicate id


STEP_EDITS: tuple[Edit, ...] = (edit_lookahead, edit_seq_id, edit_token_ids, edit_lengths,
                                edit_seq_data, edit_sampling, edit_group, edit_prefix,
                                edit_batch)


# -- structured edits of proposals -----------------------------------------------------------

_NP = {tensor_pb2.DTYPE_INT64: "<i8", tensor_pb2.DTYPE_FLOAT32: "<f4"}


def _set_elements(rng, t: tensor_pb2.Tensor, values: list) -> None:
    """Overwrite one to three elements of a dense int64 / float32 tensor."""
    if t.HasField("sparse_rows") or t.dtype not in _NP or not t.data or len(t.data) % 8:
        return
    a = np.frombuffer(t.data, dtype=_NP[t.dtype]).copy()
    for _ in range(rng.randrange(1, 4)):
        a[rng.randrange(a.size)] = rng.choice(values)
    t.data = a.tobytes()


def edit_proposal_ids(rng, m):
    """Ids outside the vocabulary, the -1 marker inside a declared length, bad padding."""
    ids, lens = m.proposals.proposal_token_ids, m.proposals.proposal_lens.data
    shape = list(ids.shape)
    inside = [(i, j) for i, n in enumerate(np.frombuffer(lens[:len(lens) // 8 * 8], "<i8"))
              for j in range(min(n, 8))]
    a = np.frombuffer(ids.data[:len(ids.data) // 8 * 8], "<i8").copy()
    inside = [(i, j) for i, j in inside if len(shape) == 2 and i < shape[0] and j < shape[1]]
    if inside and a.size == math.prod(shape) and rng.random() < 0.6:
        a = a.reshape(shape)
        a[rng.choice(inside)] = rng.choice([-1, -1, *BAD_IDS])
        ids.data = a.tobytes()
    else:
        _set_elements(rng, ids, BAD_IDS)


def edit_proposal_lens(rng, m):
    _set_elements(rng, m.proposals.proposal_lens, [-1, 5, 17, 2**31, 2**63 - 1, -2**63])


def edit_tensor_layout(rng, m):
    """A tensor's shape, dtype or byte count that disagrees with the batch or itself."""
    name = rng.choice(["proposal_token_ids", "proposal_lens", "proposal_probs"])
    t = getattr(m.proposals, name)
    choice = rng.randrange(5)
    if choice == 0 and t.shape:
        t.shape[rng.randrange(len(t.shape))] = rng.choice(BAD_DIMS)
    elif choice == 1:
        t.shape.append(rng.choice(BAD_DIMS))
    elif choice == 2:
        t.dtype = rng.randrange(7)
    elif choice == 3:
        t.data = t.data[:rng.randrange(len(t.data) + 1)] + bytes(rng.randrange(9))
    else:
        m.proposals.ClearField(name)


def edit_probs(rng, m):
    """Draft probabilities: NaN, infinite, negative, above 1, unnormalised, or badly sparse."""
    B, k = len(m.request.seq_group_metadata_list), min(max(m.request.num_lookahead_slots, 0), 8)
    probs = torch.softmax(torch.randn(B, k, VOCAB), -1)  # [B, k, V]
    choice = rng.randrange(6)
    if probs.numel() and choice < 4:
        flat = probs.view(-1)
        flat[rng.randrange(flat.numel())] = [NAN, INF, -0.5, 1.5][choice]
    elif probs.numel() and choice == 4:
        probs *= rng.choice([0.0, 0.5, 2.0])
    m.proposals.proposal_probs.CopyFrom(codec.tensor_to_proto(probs, sparse=choice == 5))
    if choice == 5 and m.proposals.proposal_probs.HasField("sparse_rows"):
        sparse = m.proposals.proposal_probs.sparse_rows
        field = rng.choice(["row_starts", "columns"])
        a = np.frombuffer(getattr(sparse, field), "<i8" if field == "row_starts" else "<i4").copy()
        if a.size:
            a[rng.randrange(a.size)] = rng.choice([-1, VOCAB, 2**31 - 1])
            setattr(sparse, field, a.tobytes())


PROPOSAL_EDITS: tuple[Edit, ...] = (edit_proposal_ids, edit_proposal_lens, edit_tensor_layout,
                                    edit_probs)


def _on_request(edit: Edit) -> Edit:
    return lambda rng, m: edit(rng, m.request)


# -- other methods ---------------------------------------------------------------------------

def edit_release(rng, m):
    choice = rng.randrange(3)
    if choice == 0:
        m.seq_ids[:] = [rng.randrange(2**40) for _ in range(rng.choice([1, 1000, 200_000]))]
    else:
        m.seq_ids.extend([rng.choice([-1, -2**63, 2**63 - 1])] * rng.choice([1, 3]))


def edit_unknown_field(rng, m):
    """An unknown field (tag 15, varint) beside the message's own."""
    m.MergeFromString(bytes([0x78, rng.randrange(128)]))


def edit_health(rng, m):
    m.service = rng.choice(["", "nope", "specdecode.v1.ScorerService", "x" * 100_000,
                            "\u00e9\u0000"])


def reflection_request(rng) -> reflection_pb2.ServerReflectionRequest:
    return reflection_pb2.ServerReflectionRequest(list_services="")


def edit_reflection(rng, m):
    text = rng.choice(["", "nope", "specdecode/v1/tensor.proto", "specdecode.v1.Tensor",
                       "x" * 100_000, "..", "\u00e9"])
    choice = rng.randrange(5)
    if choice == 0:
        m.file_by_filename = text
    elif choice == 1:
        m.file_containing_symbol = text
    elif choice == 2:
        m.file_containing_extension.containing_type = text
        m.file_containing_extension.extension_number = rng.choice(BAD_INT32)
    elif choice == 3:
        m.all_extension_numbers_of_type = text
    else:
        m.host = text


@dataclass(frozen=True)
class Method:
    path: str  # /package.Service/Method
    role: str  # proposer | scorer
    valid: Callable[[random.Random], Message]
    edits: tuple[Edit, ...]
    bidi: bool = False  # reflection: a stream of requests and responses


def methods(role: str) -> list[Method]:
    """Every method a proposer or scorer serves, health and reflection included."""
    if role == "proposer":
        service, step = "ProposerService", Method(
            "/specdecode.v1.ProposerService/GetProposals", role,
            lambda rng: proposer_service_pb2.GetProposalsRequest(request=step_request(rng)),
            tuple(map(_on_request, STEP_EDITS)))
    else:
        service, step = "ScorerService", Method(
            "/specdecode.v1.ScorerService/ScoreProposals", role, score_request,
            (*map(_on_request, STEP_EDITS), *PROPOSAL_EDITS, *PROPOSAL_EDITS))
    return [
        step,
        Method(f"/specdecode.v1.{service}/GetModelInfo", role,
               lambda rng: model_info_pb2.GetModelInfoRequest(), (edit_unknown_field,)),
        Method(f"/specdecode.v1.{service}/ReleaseSequences", role,
               lambda rng: model_info_pb2.ReleaseSequencesRequest(seq_ids=[rng.randrange(99)]),
               (edit_release, edit_unknown_field)),
        Method("/grpc.health.v1.Health/Check", role,
               lambda rng: health_pb2.HealthCheckRequest(), (edit_health,)),
        Method("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", role,
               reflection_request, (edit_reflection, edit_unknown_field), bidi=True),
    ]


# -- byte mutations --------------------------------------------------------------------------

def mutate_bytes(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    """A serialized message with random bytes, flipped bits, a cut, extreme bytes, an
    insertion, a splice with another message, or a duplicated slice."""
    b = bytearray(data)
    kind = rng.randrange(7)
    if kind == 0 or not b:  # random bytes
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 120)))
    if kind == 1:  # flip bits
        for _ in range(rng.randrange(1, 6)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == 2:  # truncate
        del b[rng.randrange(len(b)):]
    elif kind == 3:  # overwrite bytes with extreme values (varints, lengths, tags)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.choice([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x1A])
    elif kind == 4:  # insert bytes
        at = rng.randrange(len(b) + 1)
        b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 10)))
    elif kind == 5:  # splice with another method's message
        other = rng.choice(others)
        b = b[:rng.randrange(len(b) + 1)] + other[rng.randrange(len(other) + 1):]
    else:  # duplicate a slice (repeated fields, overlong messages)
        start = rng.randrange(len(b))
        b += b[start:start + rng.randrange(1, 40)]
    return bytes(b)


# -- sending ---------------------------------------------------------------------------------

def message_for(rng: random.Random, method: Method, structured: bool) -> Message:
    m = method.valid(rng)
    if structured:
        for edit in rng.sample(method.edits, min(len(method.edits), rng.choice([1, 1, 2, 3]))):
            edit(rng, m)
    return m


def call(channel: grpc.Channel, method: Method, raw: bytes,
         timeout: float) -> tuple[grpc.StatusCode, str]:
    try:
        if method.bidi:
            for _ in channel.stream_stream(method.path)(iter([raw, raw]), timeout=timeout):
                pass
        else:
            channel.unary_unary(method.path)(raw, timeout=timeout)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""


@dataclass
class FuzzResult:
    codes: dict[str, Counter]  # method path -> status code name -> calls
    failures: list[tuple[str, str, str, str]]  # (method, kind, code, details), 5 per method

    def table(self) -> str:
        names = sorted({c for counts in self.codes.values() for c in counts})
        lines = ["| method | calls | " + " | ".join(names) + " |",
                 "|---|---:|" + "---:|" * len(names)]
        for path, counts in self.codes.items():
            lines.append(f"| {path} | {sum(counts.values())} | "
                         + " | ".join(str(counts.get(n, 0)) for n in names) + " |")
        return "\n".join(lines)


def fuzz(channels: dict[str, grpc.Channel], roles: list[str], per_method: int, seed: int,
         timeout: float = 60.0) -> FuzzResult:
    """`per_method` messages to every method of each role's service, half structured and
    half byte-mutated (of a valid or a structured message); fixed seed."""
    rng = random.Random(seed)
    all_methods = [m for role in roles for m in methods(role)]
    others = [m.valid(rng).SerializeToString() for m in all_methods]
    result = FuzzResult({m.path if len(roles) == 1 else f"{m.role} {m.path}": Counter()
                         for m in all_methods}, [])
    for i in range(per_method):
        for method, counts in zip(all_methods, result.codes.values()):
            kind = "structured" if i % 2 == 0 else "bytes"
            message = message_for(rng, method, structured=kind == "structured" or rng.random() < 0.5)
            raw = message.SerializeToString()
            if kind == "bytes":
                raw = mutate_bytes(rng, raw, others)
            code, details = call(channels[method.role], method, raw, timeout)
            counts[code.name] += 1
            if code in FAILURES and sum(f[0] == method.path for f in result.failures) < 5:
                result.failures.append((method.path, kind, code.name, details[:300]))
    return result
