"""What the proposer and scorer servicers share: GetModelInfo, ReleaseSequences, one model
call at a time (specdecode.model_access: stopped when its caller is gone), and decoding a
step's request against the served model and this service's limits (specdecode.limits)."""

from __future__ import annotations

from specdecode import wire
from specdecode.limits import ServiceLimits
from specdecode.model_access import ModelAccess
from specdecode.model_info import ModelInfo
from specdecode.sequence import ExecuteModelRequest, InvalidRequestError
from specdecode.server import Deferred, map_errors
from specdecode.v1 import model_info_pb2


class ModelServicer(Deferred):
    """What the proposer and scorer servicers share: GetModelInfo, ReleaseSequences, and one
    model call at a time. Serves after attach(info=ModelInfo, <role>=its proposer/scorer)."""

    info: ModelInfo

    def __init__(self, limits: ServiceLimits = ServiceLimits()):
        self.model = ModelAccess()
        self.limits = limits

    @property
    def model_name(self) -> str:
        return self.info.model_name

    def _core(self):
        """The proposer or scorer this servicer fronts."""
        raise NotImplementedError

    @map_errors
    async def GetModelInfo(self, request, context):
        return wire.model_info_to_proto(self.info)

    @map_errors
    async def ReleaseSequences(self, request, context):
        released = await self.model.run(self._core().release_sequences, list(request.seq_ids))
        return model_info_pb2.ReleaseSequencesResponse(released=released)


def decode_request(m, info: ModelInfo,
                   limits: ServiceLimits = ServiceLimits()) -> ExecuteModelRequest:
    """Check the step's batch against this service's limits, decode it, and validate it
    against this service's model."""
    limits.check(m, info.max_model_len)
    req = wire.request_from_proto(m, field="request")
    try:
        req.validate(info.vocab_size, info.max_model_len)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"request.{exc.field}", exc.detail) from None
    return req
