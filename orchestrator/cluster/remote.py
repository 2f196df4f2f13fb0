"""The proposer and scorer as seen from the orchestrator: gRPC clients that implement the
same one-method interfaces as the in-process proposers and scorers, so the engine cannot
tell them apart. Each counts the bytes it sends and receives, the sequences it had to resend
in full, and the time the service reported busy. Step requests carry sequence deltas
(specdecode.wire.delta_encoder: what this replica last received) unless built with deltas=False.

Every call made under a sampled span gets a CLIENT span, and the current trace context
travels in the call's metadata (W3C traceparent), so the service's server span is the
client span's child. Calls outside any span (start-up checks, releases after a cancel) make
no span and send no context."""

from __future__ import annotations

import json

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from orchestrator.config import ServiceSecurity
from orchestrator.engine.deadlines import CallCancelled, current_cancel
from specdecode.wire.delta_encoder import DeltaEncoder
from specdecode.telemetry import tracing
from specdecode.wire import codec
from orchestrator.cluster.routing import split_address
from specdecode.serving.auth import with_token
from specdecode.interfaces import (SpeculativeProposals, SpeculativeProposer, SpeculativeScorer,
                                   SpeculativeScores)
from specdecode.model_info import ModelInfo
from specdecode.sequence import ExecuteModelRequest
from specdecode.serving.tls import channel_credentials
from specdecode.v1 import (model_info_pb2, proposer_service_pb2, proposer_service_pb2_grpc,
                           scorer_service_pb2, scorer_service_pb2_grpc, sequence_pb2)


def keepalive_options(interval_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """Keepalive pings every `interval_s` (also between calls) find a link that stopped
    forwarding without closing (a host that froze, a proxy or network that went quiet): no
    ack within `timeout_s` closes the connection, its calls fail UNAVAILABLE and the health
    check finds the replica unreachable, in at most interval + timeout seconds (+ one
    health interval); the servers permit pings this often
    (specdecode.serving.server.KEEPALIVE_SERVER_OPTIONS)."""
    timeout_ms = int(timeout_s * 1000)
    # ping_timeout: every ping's (60 s by default): a BDP ping in flight when the link went
    # quiet held keepalive back for that long.
    return [("grpc.keepalive_time_ms", int(interval_s * 1000)),
            ("grpc.keepalive_timeout_ms", timeout_ms), ("grpc.http2.ping_timeout_ms", timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


# A replica that restarts is reconnected to within a second (gRPC's default back-off grows
# to two minutes, which would keep a recovered replica out that long).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200),
                     ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 1000)]

# gRPC's own retries, for the idempotent housekeeping calls only: a step call that fails is
# retried by the orchestrator on another replica (orchestrator.cluster.replicas), not on this one.
_RETRY_POLICY = {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
                 "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": f"specdecode.v1.{service}", "method": method}
             for service in ("ProposerService", "ScorerService")
             for method in ("GetModelInfo", "ReleaseSequences")],
    "retryPolicy": _RETRY_POLICY}]})


def open_channel(address: str, options: list[tuple[str, int]],
                 authority: str | None = None,
                 security: ServiceSecurity = ServiceSecurity()) -> grpc.Channel:
    """The one place the orchestrator opens a channel to a proposer or scorer replica.
    `address` is the replica's IP:PORT; `authority` the HOST:PORT it was resolved from (sent
    as :authority, as a channel to that name would; over TLS the replica's certificate is
    verified against its host, e.g. a headless Service's name, not the pod IP). `security`:
    TLS and/or a bearer token. `options` carry the keepalive (keepalive_options) with the
    server's channel options."""
    extra = [] if authority in (None, address) else [("grpc.default_authority", authority)]
    options = [*options, *RECONNECT_OPTIONS, ("grpc.enable_retries", 1),
               ("grpc.service_config", SERVICE_CONFIG), *extra]
    if security.tls is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        if authority:
            options.append(("grpc.ssl_target_name_override", split_address(authority)[0]))
        channel = grpc.secure_channel(address, channel_credentials(security.tls), options=options)
    return with_token(channel, security.token)


class _RequestEncoding:
    """The step's request encoded once: the engine hands the proposer and then the scorer
    the same ExecuteModelRequest object, so the second call reuses the first's protobuf."""

    def __init__(self):
        self._last: tuple[ExecuteModelRequest, sequence_pb2.ExecuteModelRequest] | None = None

    def __call__(self, req: ExecuteModelRequest) -> sequence_pb2.ExecuteModelRequest:
        last = self._last  # one read: replicas' calls may encode from several threads
        if last is None or last[0] is not req:
            last = self._last = (req, codec.request_to_proto(req))
        return last[1]


_encode_request = _RequestEncoding()


class _Remote:
    """A client of one replica. Calls fail fast when the replica is unreachable (no
    wait_for_ready: the caller moves the work elsewhere) and carry a deadline: `timeout`
    per call, else timeout_s."""

    service = ""  # the full gRPC service name

    def __init__(self, channel: grpc.Channel, stub, timeout_s: float, address: str = "",
                 deltas: bool = True):
        self.channel = channel
        self.stub, self.timeout_s = stub(channel), timeout_s
        self.bytes_sent = 0
        self.bytes_received = 0
        self.full_resends = 0  # sequences resent in full because the replica lacked them
        self.service_seconds = 0.0  # time the replica reported busy on step calls
        self.peer = address
        host, _, port = address.rpartition(":")  # OpenTelemetry: server.address, server.port apart
        self._peer_attributes = ({"server.address": host.strip("[]"), "server.port": int(port)}
                                 if port.isdigit() else {"server.address": address})
        self.deltas = DeltaEncoder() if deltas else None

    def _step_call(self, name: str, req: ExecuteModelRequest, build, timeout: float | None):
        """A step call whose request is `build(encoded step request)`: sequences travel in
        the delta form where this replica received them before; those it reports missing
        (restarted, evicted, new to it) are resent in full, once, within the same step."""
        if self.deltas is None:
            response = self._call(name, build(_encode_request(req)), timeout)
        else:
            response = self._call(name, build(self.deltas.encode(req)), timeout)
            if response.missing_seq_ids:
                missing = set(response.missing_seq_ids)
                self.full_resends += len(missing)
                self.deltas.forget(missing)
                response = self._call(name, build(self.deltas.encode(req, full=missing)),
                                      timeout)
                if response.missing_seq_ids:  # sequences in the full form cannot be missing
                    raise RuntimeError(f"the {self.service} at {self.peer} reported sequences "
                                       f"{list(response.missing_seq_ids)} missing after a full "
                                       f"resend")
            self.deltas.commit(req)
        self.service_seconds += response.service_seconds
        return response

    def _call(self, name: str, request, timeout: float | None = None):
        with tracing.child_span(f"{self.service}/{name}", {
                "rpc.system": "grpc", "rpc.service": self.service, "rpc.method": name,
                **self._peer_attributes}, kind=SpanKind.CLIENT,
                tracer_name="specdecode.client") as span:
            try:
                response = self._invoke(name, request,
                                        self.timeout_s if timeout is None else timeout)
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

    def _invoke(self, name: str, request, timeout: float):
        """The call; under a Cancel (orchestrator.engine.deadlines.cancelled_by) one that
        stops on the wire when cancelled, raising CallCancelled."""
        method, cancel = getattr(self.stub, name), current_cancel()
        if cancel is None:
            return method(request, timeout=timeout, metadata=tracing.trace_metadata())
        call = method.future(request, timeout=timeout, metadata=tracing.trace_metadata())
        cancel.on_cancel(call.cancel)
        try:
            return call.result()
        except grpc.FutureCancelledError:
            raise CallCancelled(f"{self.service}/{name} to {self.peer} cancelled") from None
        except grpc.RpcError as exc:
            if cancel.is_set and exc.code() == grpc.StatusCode.CANCELLED:
                raise CallCancelled(f"{self.service}/{name} to {self.peer} cancelled") from None
            raise

    def model_info(self) -> ModelInfo:
        info = self.stub.GetModelInfo(model_info_pb2.GetModelInfoRequest(),
                                      timeout=self.timeout_s)
        return codec.model_info_from_proto(info)

    def release_sequences(self, seq_ids: list[int]) -> int:
        if not seq_ids:
            return 0
        if self.deltas is not None:
            self.deltas.forget(seq_ids)
        request = model_info_pb2.ReleaseSequencesRequest(seq_ids=seq_ids)
        return self._call("ReleaseSequences", request).released


class RemoteProposer(_Remote, SpeculativeProposer):
    service = "specdecode.v1.ProposerService"

    def __init__(self, channel: grpc.Channel, timeout_s: float = 60.0, address: str = "",
                 deltas: bool = True):
        super().__init__(channel, proposer_service_pb2_grpc.ProposerServiceStub, timeout_s,
                         address, deltas)

    def get_proposals(self, execute_model_req: ExecuteModelRequest,
                      timeout: float | None = None) -> SpeculativeProposals:
        response = self._step_call("GetProposals", execute_model_req,
                                   lambda encoded: proposer_service_pb2.GetProposalsRequest(
                                       request=encoded), timeout)
        return codec.proposals_from_proto(response.proposals, "proposals",
                                          batch_size=len(execute_model_req.seq_group_metadata_list))


class RemoteScorer(_Remote, SpeculativeScorer):
    service = "specdecode.v1.ScorerService"

    def __init__(self, channel: grpc.Channel, timeout_s: float = 60.0, address: str = "",
                 deltas: bool = True):
        super().__init__(channel, scorer_service_pb2_grpc.ScorerServiceStub, timeout_s,
                         address, deltas)

    def score_proposals(self, execute_model_req: ExecuteModelRequest,
                        proposals: SpeculativeProposals,
                        timeout: float | None = None) -> SpeculativeScores:
        encoded_proposals = codec.proposals_to_proto(proposals)
        response = self._step_call("ScoreProposals", execute_model_req,
                                   lambda encoded: scorer_service_pb2.ScoreProposalsRequest(
                                       request=encoded, proposals=encoded_proposals), timeout)
        return codec.scores_from_proto(response.scores, "scores",
                                       batch_size=len(execute_model_req.seq_group_metadata_list),
                                       num_positions=execute_model_req.num_lookahead_slots + 1)
