"""A peer's bad input over real processes (issue 25, part A): the issue's rows, and a fuzz
run over every method of the proposer (draft model and n-gram) and the scorer, structured
out-of-range values and byte mutations: no UNKNOWN, INTERNAL or UNAVAILABLE, and the
services healthy and exact after."""

from __future__ import annotations

import math
import random

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdecode.wire import codec
from specdecode.interfaces import SpeculativeProposals
from specdecode.v1 import scorer_service_pb2
from specdecode_stack.local import LocalStack, StackConfig
from tests.integration import fuzzing
from tests.support.metrics import scrape_metrics

SCORE = "/specdecode.v1.ScorerService/ScoreProposals"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


@pytest.fixture(scope="module", params=["draft", "ngram"])
def stack(request, tiny_model_dirs):
    draft = tiny_model_dirs["draft"] if request.param == "draft" else "ngram"
    with LocalStack(StackConfig(target_model=tiny_model_dirs["target"], draft_model=draft,
                                tokenizer="none", device="cpu", port=0)) as s:
        yield s


def channels(stack: LocalStack) -> dict[str, grpc.Channel]:
    return {role: grpc.insecure_channel(address)
            for role, address in stack.service_addresses.items()}


def score(k: int, ids: list[list[int]], lens: list[int], temperature: float = 0.0,
          probs: torch.Tensor | None = None) -> scorer_service_pb2.ScoreProposalsRequest:
    """One sequence of 5 tokens, k = len(ids[0]), with these proposals."""
    rng = random.Random(0)
    m = fuzzing.step_request(rng)
    del m.seq_group_metadata_list[1:]
    sg = m.seq_group_metadata_list[0]
    sg.sampling_params.temperature = temperature
    m.num_lookahead_slots = k
    proposals = SpeculativeProposals(torch.tensor(ids), probs, torch.tensor(lens))
    return scorer_service_pb2.ScoreProposalsRequest(
        request=m, proposals=codec.proposals_to_proto(proposals))


def call(channel: grpc.Channel, raw: bytes, method: str = SCORE) -> tuple[grpc.StatusCode, str]:
    kind = [m for m in fuzzing.methods("scorer") if m.path == method] or \
        [fuzzing.Method(method, "scorer", None, ())]
    return fuzzing.call(channel, kind[0], raw, timeout=60)


def test_the_issue_rows_answer_invalid_argument_naming_the_field(stack):
    scorer = channels(stack)["scorer"]
    nan_probs = torch.full((1, 1, fuzzing.VOCAB), 1 / fuzzing.VOCAB)
    nan_probs[0, 0, 3] = math.nan
    rows = [  # (message, text the details start with)
        (score(1, [[-1]], [1]), "proposals.proposal_token_ids: [0, 0] is -1"),
        (score(1, [[3]], [1], 0.8, nan_probs), "proposals.proposal_probs: values must be finite"),
        (score(1, [[3]], [1], 1e-40),
         "request.seq_group_metadata_list[0].sampling_params.temperature: must be a finite "
         "number, 0 (greedy) or >= 1e-05"),
    ]
    for message, text in rows:
        code, details = call(scorer, message.SerializeToString())
        assert (code, details[:len(text)]) == (grpc.StatusCode.INVALID_ARGUMENT, text), details
    for role, address in stack.service_addresses.items():  # one byte 0x02 to reflection
        with grpc.insecure_channel(address) as channel:
            code, details = call(channel, b"\x02", REFLECTION)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (role, code, details)
        assert details.startswith("request: not a valid ServerReflectionInfo request"), details


def fuzz_and_check(stack: LocalStack, per_method: int, seed: int) -> fuzzing.FuzzResult:
    """Fuzz both services; then both are alive, SERVING, and score a fixed step as before."""
    chans = channels(stack)
    reference = score(2, [[3, 4]], [2]).SerializeToString()

    def scores() -> bytes:  # without service_seconds, which differs from call to call
        raw = chans["scorer"].unary_unary(SCORE)(reference, timeout=60)
        return scorer_service_pb2.ScoreProposalsResponse.FromString(raw).scores.SerializeToString()
    before = scores()
    result = fuzzing.fuzz(chans, ["proposer", "scorer"], per_method, seed)
    print(f"\n{per_method} messages per method, seed {seed}:\n{result.table()}")
    assert not result.failures, result.failures
    for role in ("proposer", "scorer"):
        assert stack.processes[role].poll() is None, role
        status = health_pb2_grpc.HealthStub(chans[role]).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=30).status
        assert status == health_pb2.HealthCheckResponse.SERVING, role
        malformed = sum(v for k, v in scrape_metrics(stack.metrics_ports[role]).items()
                        if k.startswith("specdecode_malformed_requests_total"))
        assert malformed > 0, role
    assert scores() == before
    return result


def test_fuzz_every_method_of_both_services(stack):
    fuzz_and_check(stack, per_method=100, seed=25)


@pytest.mark.slow
def test_fuzz_1000_messages_per_method(stack):
    fuzz_and_check(stack, per_method=1000, seed=2025)
