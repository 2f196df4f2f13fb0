"""What the proposer and scorer servicers share: GetModelInfo, ReleaseSequences, one model
call at a time (specdecode.serving.model_access: stopped when its caller is gone), decoding a step's
request (sequence deltas completed from the service's TokenStore) against the served model
and this service's limits (specdecode.serving.limits), and the leases that reclaim the state of
sequences nobody released (specdecode.serving.leases)."""

from __future__ import annotations

import asyncio
import logging

from specdecode.wire import codec
from specdecode.wire.delta_store import TokenStore, resolve_request
from specdecode.errors import InvalidRequestError
from specdecode.grammar.matcher import Grammars
from specdecode.serving.leases import EXPIRED, HELD, Leases
from specdecode.serving.limits import ServiceLimits
from specdecode.serving.model_access import ModelAccess
from specdecode.model_info import ModelInfo
from specdecode.errors import fields_of
from specdecode.sequence import ExecuteModelRequest
from specdecode.serving.server import Deferred, map_errors
from specdecode.v1 import model_info_pb2, sequence_pb2

log = logging.getLogger(__name__)


class ModelServicer(Deferred):
    """What the proposer and scorer servicers share: GetModelInfo, ReleaseSequences, and one
    model call at a time. Serves after attach(info=ModelInfo, <role>=its proposer/scorer);
    reclaims expired leases once `keep_leases` runs."""

    info: ModelInfo
    grammars: Grammars | None = None  # attached when the model has a tokenizer

    def __init__(self, limits: ServiceLimits = ServiceLimits()):
        self.model = ModelAccess()
        self.limits = limits
        self.sequences = TokenStore()  # what each sequence's delta requests extend
        self.leases = Leases(limits.sequence_lease_seconds)
        HELD.set_function(lambda: len(self.leases))
        self._reclaimer: asyncio.Task | None = None  # held: the loop keeps weak references

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
        return codec.model_info_to_proto(self.info)

    @map_errors
    async def ReleaseSequences(self, request, context):
        self.limits.check_release(request)
        released = await self._release(list(request.seq_ids))
        return model_info_pb2.ReleaseSequencesResponse(released=released)

    async def _release(self, seq_ids: list[int]) -> int:
        self.leases.forget(seq_ids)
        self.sequences.release(seq_ids)
        return await self.model.run(self._core().release_sequences, seq_ids)

    def keep_leases(self) -> None:
        """Start reclaiming the state of sequences whose lease ran out (in the event loop)."""
        self._reclaimer = asyncio.get_running_loop().create_task(self._reclaim())

    async def _reclaim(self) -> None:
        while True:
            await asyncio.sleep(self.leases.check_interval)
            expired = self.leases.expired()
            if not expired:
                continue
            try:
                await self._release(expired)
            except Exception:  # keep reclaiming: a dead reclaimer would leak again
                log.exception("reclaiming %d expired sequences failed", len(expired))
                continue
            EXPIRED.inc(len(expired))
            log.info("reclaimed %d sequences nobody released for %.0fs", len(expired),
                     self.leases.seconds)

    def decode(self, m: sequence_pb2.ExecuteModelRequest, info: ModelInfo,
               ) -> tuple[ExecuteModelRequest | None, list[int]]:
        """Check the step's batch against this service's limits, renew its sequences' leases
        and decode it; its sequences may travel in the delta form: (the request with every
        sequence's full ids, validated against `info`, []), or (None, ids of the delta
        sequences whose prefix this service does not hold)."""
        self.limits.check(m, info.max_model_len)
        self.leases.touch(seq_id for sg in m.seq_group_metadata_list for seq_id in sg.seq_data)
        req = codec.request_from_proto(m, field="request")
        missing = resolve_request(m, req, self.sequences)
        if missing:
            return None, missing
        with fields_of("request"):
            req.validate(info.vocab_size, info.max_model_len)
        return req, []
