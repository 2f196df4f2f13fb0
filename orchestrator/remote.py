"""The proposer and scorer as seen from the orchestrator: gRPC clients that implement the
same one-method interfaces as the in-process proposers and scorers, so the engine cannot
tell them apart. Each counts the bytes it sends and receives.

Every call made under a sampled span gets a CLIENT span, and the current trace context
travels in the call's metadata (W3C traceparent), so the service's server span is the
client span's child. Calls outside any span (start-up checks, releases after a cancel) make
no span and send no context."""

from __future__ import annotations

import time

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from specdecode import tracing, wire
from specdecode.health import wait_serving
from specdecode.interfaces import (SpeculativeProposals, SpeculativeProposer, SpeculativeScorer,
                                   SpeculativeScores)
from specdecode.model_info import ModelInfo
from specdecode.sequence import ExecuteModelRequest
from specdecode.v1 import (model_info_pb2, proposer_service_pb2, proposer_service_pb2_grpc,
                           scorer_service_pb2, scorer_service_pb2_grpc, sequence_pb2)


class ServiceUnreachableError(RuntimeError):
    pass


def connect(role: str, address: str, options: list[tuple[str, int]],
            timeout_s: float) -> grpc.Channel:
    """A channel to a service that reports SERVING, or ServiceUnreachableError naming the
    role and address. (A service opens its port before its model is loaded and answers
    UNAVAILABLE until then, so a reachable port is not enough.)"""
    deadline = time.monotonic() + timeout_s
    channel = grpc.insecure_channel(address, options=options)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise ServiceUnreachableError(
            f"cannot reach the {role} at {address} within {timeout_s:.0f}s "
            f"(is `specdecode serve {role}` running there?)") from None
    if not wait_serving(channel, deadline - time.monotonic()):
        channel.close()
        raise ServiceUnreachableError(
            f"the {role} at {address} did not report SERVING within {timeout_s:.0f}s "
            f"(still loading its model?)")
    return channel


class _RequestEncoding:
    """The step's request encoded once: the engine hands the proposer and then the scorer
    the same ExecuteModelRequest object, so the second call reuses the first's protobuf."""

    def __init__(self):
        self._last: tuple[ExecuteModelRequest, sequence_pb2.ExecuteModelRequest] | None = None

    def __call__(self, req: ExecuteModelRequest) -> sequence_pb2.ExecuteModelRequest:
        if self._last is None or self._last[0] is not req:
            self._last = (req, wire.request_to_proto(req))
        return self._last[1]


_encode_request = _RequestEncoding()  # used from the engine thread only


class _Remote:
    service = ""  # the full gRPC service name

    def __init__(self, channel: grpc.Channel, stub, timeout_s: float, address: str = ""):
        self.stub, self.timeout_s = stub(channel), timeout_s
        self.bytes_sent = 0
        self.bytes_received = 0
        self.peer = address

    def _call(self, name: str, request):
        with tracing.child_span(f"{self.service}/{name}", {
                "rpc.system": "grpc", "rpc.service": self.service, "rpc.method": name,
                "server.address": self.peer}, kind=SpanKind.CLIENT,
                tracer_name="specdecode.client") as span:
            try:
                response = getattr(self.stub, name)(request, timeout=self.timeout_s,
                                                    wait_for_ready=True,
                                                    metadata=tracing.trace_metadata())
            except grpc.RpcError as exc:
                if span.is_recording() and isinstance(exc, grpc.Call):
                    span.set_attribute("rpc.grpc.status_code", exc.code().value[0])
                    span.set_status(Status(StatusCode.ERROR, f"{exc.code().name}: {exc.details()}"))
                raise
            sent, received = request.ByteSize(), response.ByteSize()
            self.bytes_sent += sent
            self.bytes_received += received
            if span.is_recording():
                span.set_attributes({"rpc.grpc.status_code": 0,
                                     "specdecode.wire.bytes_sent": sent,
                                     "specdecode.wire.bytes_received": received})
        return response

    def model_info(self) -> ModelInfo:
        info = self.stub.GetModelInfo(model_info_pb2.GetModelInfoRequest(),
                                      timeout=self.timeout_s, wait_for_ready=True)
        return wire.model_info_from_proto(info)

    def release_sequences(self, seq_ids: list[int]) -> int:
        if not seq_ids:
            return 0
        request = model_info_pb2.ReleaseSequencesRequest(seq_ids=seq_ids)
        return self._call("ReleaseSequences", request).released


class RemoteProposer(_Remote, SpeculativeProposer):
    service = "specdecode.v1.ProposerService"

    def __init__(self, channel: grpc.Channel, timeout_s: float = 60.0, address: str = ""):
        super().__init__(channel, proposer_service_pb2_grpc.ProposerServiceStub, timeout_s, address)

    def get_proposals(self, execute_model_req: ExecuteModelRequest) -> SpeculativeProposals:
        request = proposer_service_pb2.GetProposalsRequest(
            request=_encode_request(execute_model_req))
        response = self._call("GetProposals", request)
        return wire.proposals_from_proto(response.proposals, "proposals",
                                         batch_size=len(execute_model_req.seq_group_metadata_list))


class RemoteScorer(_Remote, SpeculativeScorer):
    service = "specdecode.v1.ScorerService"

    def __init__(self, channel: grpc.Channel, timeout_s: float = 60.0, address: str = ""):
        super().__init__(channel, scorer_service_pb2_grpc.ScorerServiceStub, timeout_s, address)

    def score_proposals(self, execute_model_req: ExecuteModelRequest,
                        proposals: SpeculativeProposals) -> SpeculativeScores:
        request = scorer_service_pb2.ScoreProposalsRequest(
            request=_encode_request(execute_model_req),
            proposals=wire.proposals_to_proto(proposals))
        response = self._call("ScoreProposals", request)
        return wire.scores_from_proto(response.scores, "scores",
                                      batch_size=len(execute_model_req.seq_group_metadata_list),
                                      num_positions=execute_model_req.num_lookahead_slots + 1)
