"""Leases over real processes (issue 25, part A): sequences a caller never released are
reclaimed by the proposer and the scorer themselves after --sequence-lease-seconds; a
sequence that comes back is resent in full (delta store) and recomputed (KV cache), and
output stays exact."""

from __future__ import annotations

import time

import grpc
import torch

from specdecode.wire import codec
from specdecode.api.client import SpecDecodeClient
from specdecode.wire.delta_store import extend_hash
from specdecode.interfaces import SpeculativeProposals
from specdecode.sequence import (ExecuteModelRequest, SamplingParams, SequenceData,
                                 SequenceGroupMetadata)
from specdecode.v1 import proposer_service_pb2, scorer_service_pb2, sequence_pb2
from specdecode_stack.local import LocalStack, StackConfig
from tests.support.metrics import scrape_metrics
from tests.support.references import reference_greedy

LEASE = 2.0
SEQ_IDS = [101, 102, 103, 104]
PROMPTS = [[5, 17, 99, 3], [1, 2, 3, 4, 5, 6], [42, 7], [9] * 10]


def step() -> sequence_pb2.ExecuteModelRequest:
    return codec.request_to_proto(ExecuteModelRequest([SequenceGroupMetadata(
        f"r{i}", False, {seq_id: SequenceData(prompt, [8])}, SamplingParams(max_tokens=8))
        for i, (seq_id, prompt) in enumerate(zip(SEQ_IDS, PROMPTS))], num_lookahead_slots=2))


def gauge(stack: LocalStack, role: str, name: str) -> float:
    """The sum of the samples of `name` (with any labels) at the role's /metrics."""
    return sum(v for k, v in scrape_metrics(stack.metrics_ports[role]).items()
               if k.split("{")[0] == name)


def test_unreleased_sequences_are_reclaimed_after_the_lease(tiny_model_dirs, target_model):
    config = StackConfig(target_model=tiny_model_dirs["target"],
                         draft_model=tiny_model_dirs["draft"], tokenizer="none", device="cpu",
                         port=0, service_args=["--sequence-lease-seconds", str(LEASE)])
    with LocalStack(config) as stack:
        proposer = grpc.insecure_channel(stack.service_addresses["proposer"])
        scorer = grpc.insecure_channel(stack.service_addresses["scorer"])
        # One step to each service, never released (a release lost with its link).
        proposer.unary_unary("/specdecode.v1.ProposerService/GetProposals")(
            proposer_service_pb2.GetProposalsRequest(request=step()).SerializeToString(),
            timeout=60)
        proposals = SpeculativeProposals(torch.full((4, 2), 3), None, torch.full((4,), 2))
        scorer.unary_unary("/specdecode.v1.ScorerService/ScoreProposals")(
            scorer_service_pb2.ScoreProposalsRequest(
                request=step(), proposals=codec.proposals_to_proto(proposals)).SerializeToString(),
            timeout=60)
        held = {role: (gauge(stack, role, "specdecode_sequence_leases"),
                       gauge(stack, role, "specdecode_kv_cache_sequences"))
                for role in ("proposer", "scorer")}
        assert held == {"proposer": (4, 4), "scorer": (4, 4)}
        deadline = time.monotonic() + 120  # the lease plus a check interval, on a busy machine
        while time.monotonic() < deadline and any(
                gauge(stack, role, name) for role in ("proposer", "scorer")
                for name in ("specdecode_sequence_leases", "specdecode_kv_cache_sequences")):
            time.sleep(0.25)
        for role in ("proposer", "scorer"):
            assert gauge(stack, role, "specdecode_sequence_leases") == 0, role
            assert gauge(stack, role, "specdecode_kv_cache_sequences") == 0, role
            assert gauge(stack, role, "specdecode_sequence_leases_expired_total") == 4, role
        # The delta form of a reclaimed sequence: the service asks for it in full.
        delta = step()
        data = delta.seq_group_metadata_list[0].seq_data[SEQ_IDS[0]]
        full = [*data.prompt_token_ids, *data.output_token_ids]
        data.prefix.length, data.prefix.hash = len(full), extend_hash(0, full)
        del data.prompt_token_ids[:], data.output_token_ids[:]
        raw = proposer.unary_unary("/specdecode.v1.ProposerService/GetProposals")(
            proposer_service_pb2.GetProposalsRequest(request=delta).SerializeToString(),
            timeout=60)
        missing = proposer_service_pb2.GetProposalsResponse.FromString(raw).missing_seq_ids
        assert list(missing) == [SEQ_IDS[0]]
        # Generation through the orchestrator (leases renewed every step) stays exact.
        with SpecDecodeClient(stack.address) as client:
            assert client.generate(PROMPTS[1], max_tokens=24).token_ids == \
                reference_greedy(target_model, PROMPTS[1], 24)
