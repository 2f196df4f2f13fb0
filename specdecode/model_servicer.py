"""What the proposer and scorer servicers share: GetModelInfo, ReleaseSequences, one model
call at a time (specdecode.model_access: stopped when its caller is gone), and decoding a
step's request (sequence deltas completed from the service's TokenStore) against the served
model and this service's limits (specdecode.limits)."""

from __future__ import annotations

import asyncio

from specdecode import wire
from specdecode.grammar.matcher import Grammars
from specdecode.limits import ServiceLimits
from specdecode.model_access import ModelAccess
from specdecode.model_info import ModelInfo
from specdecode.errors import InvalidRequestError
from specdecode.sequence import ExecuteModelRequest
from specdecode.server import Deferred, map_errors
from specdecode.deltas.store import TokenStore, resolve_request
from specdecode.v1 import model_info_pb2


class ModelServicer(Deferred):
    """What the proposer and scorer servicers share: GetModelInfo, ReleaseSequences, and one
    model call at a time. Serves after attach(info=ModelInfo, <role>=its proposer/scorer)."""

    info: ModelInfo
    grammars: Grammars | None = None  # attached when the model has a tokenizer

    def __init__(self, limits: ServiceLimits = ServiceLimits()):
        self.model = ModelAccess()
        self.limits = limits
        self.sequences = TokenStore()  # what each sequence's delta requests extend

    @property
    def model_name(self) -> str:
        return self.info.model_name

    def _core(self):
        """The proposer or scorer this servicer fronts."""
        raise NotImplementedError

    async def prepare_grammars(self, req: ExecuteModelRequest, required: bool) -> None:
        """Compile the step's grammars off the event loop, within the compile time limit
        (later mask calls only hit the cache). Without grammars, a constrained sequence is
        refused when `required` (a scorer: the target's masks make the output) and drafted
        unconstrained otherwise (a proposer: verification stays exact)."""
        groups = req.seq_group_metadata_list
        field = "request.seq_group_metadata_list"
        if self.grammars is not None:
            if any(sg.sampling_params.structured_output for sg in groups):
                await asyncio.to_thread(self.grammars.compile_all, groups, field)
            return
        for i, sg in enumerate(groups):
            if required and sg.sampling_params.structured_output is not None:
                raise InvalidRequestError(f"{field}[{i}].sampling_params.structured_output",
                                          f"{self.info.model_name} has no tokenizer to build "
                                          "grammar masks with")

    @map_errors
    async def GetModelInfo(self, request, context):
        return wire.model_info_to_proto(self.info)

    @map_errors
    async def ReleaseSequences(self, request, context):
        self.sequences.release(request.seq_ids)
        released = await self.model.run(self._core().release_sequences, list(request.seq_ids))
        return model_info_pb2.ReleaseSequencesResponse(released=released)


def decode_request(m, info: ModelInfo, store: TokenStore,
                   limits: ServiceLimits = ServiceLimits(),
                   ) -> tuple[ExecuteModelRequest | None, list[int]]:
    """Check the step's batch against this service's limits and decode it; its sequences may
    travel in the delta form: (the request with every sequence's full ids, validated against
    this service's model, []), or (None, ids of the delta sequences whose prefix `store`
    does not hold)."""
    limits.check(m, info.max_model_len)
    req = wire.request_from_proto(m, field="request")
    missing = resolve_request(m, req, store)
    if missing:
        return None, missing
    try:
        req.validate(info.vocab_size, info.max_model_len)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"request.{exc.field}", exc.detail) from None
    return req, []
