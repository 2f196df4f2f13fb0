"""ProposerService: protobuf in, dataclasses to the proposer, protobuf out."""

from __future__ import annotations

import time
import logging
from dataclasses import dataclass

from proposer_svc.draft import DraftModelProposer
from proposer_svc.ngram import NgramProposer
from proposer_svc.pruned_head import prune_lm_head
from specdecode.wire import codec
from specdecode.executor.calibration import calibration_widths
from specdecode.executor.cost_cache import CostCache, calibrate_or_reuse, cost_cache
from specdecode.interfaces import SpeculativeProposer
from specdecode.grammar.matcher import Grammars
from specdecode.model_info import NGRAM, ModelInfo
from specdecode.models.model_loading import ModelOptions, load_grammars, load_runner, model_info_for
from specdecode.executor.model_runner import ModelRunner
from specdecode.serving.model_servicer import ModelServicer
from specdecode.models.checkpoints import resolve_model_dir
from specdecode.serving.server import map_errors
from specdecode.v1 import proposer_service_pb2, proposer_service_pb2_grpc
from specdecode.executor.worker import ModelWorker

log = logging.getLogger(__name__)

# An n-gram proposer proposes ids taken from the sequence itself: any vocabulary fits.
NGRAM_INFO = ModelInfo(model_name=NGRAM, vocab_size=0, tokenizer_fingerprint="",
                       max_model_len=2**31 - 1, device="cpu", dtype="", role="proposer")


@dataclass(frozen=True)
class LoadedProposer:
    proposer: SpeculativeProposer
    info: ModelInfo
    runner: ModelRunner | None  # the draft model's; None for the n-gram proposer
    grammars: Grammars | None = None  # None: drafts ignore grammars (n-gram, no tokenizer)
    cost_cache: CostCache | None = None  # where its forward-cost table is kept


def build_proposer(options: ModelOptions, draft_vocab_size: int = 0,
                   draft_confidence: float = 0.0) -> LoadedProposer:
    """The proposer that `options` name: "ngram", or a draft model loaded from its path,
    its forward costs measured (calibration.calibrate) or kept from an earlier start
    (cost_cache). draft_vocab_size: the draft scores only that many most frequent token
    ids (0 = all; proposer_svc.pruned_head); draft_confidence: a draft stops after a token
    it was less sure of (0 = never; proposer_svc.draft)."""
    if options.model == NGRAM:
        return LoadedProposer(NgramProposer(NGRAM_INFO.max_model_len), NGRAM_INFO, None)
    if draft_vocab_size < 0:
        raise ValueError(f"draft_vocab_size: must be >= 0, got {draft_vocab_size}")
    runner, fingerprint = load_runner(options)
    model_dir = resolve_model_dir(options.model)
    kept = prune_lm_head(runner.model, model_dir, draft_vocab_size)
    log.info("draft head scores %d of %d token ids", kept, runner.vocab_size)
    cache = cost_cache(options.cost_cache, model_dir, "proposer", options,
                       device=str(runner.device), draft_vocab_size=draft_vocab_size)
    costs = calibrate_or_reuse(runner, cache, calibration_widths(options.calibration_width,
                                                                 catch_up=True))
    grammars = load_grammars(options, runner.vocab_size, runner.max_cached_sequences)
    info = model_info_for(runner, options, fingerprint, role="proposer", forward_cost=costs,
                          structured_output=grammars is not None)
    worker = ModelWorker(runner, "draft", grammars)
    return LoadedProposer(DraftModelProposer(worker, draft_confidence), info, runner, grammars,
                          cache)


class ProposerServicer(ModelServicer, proposer_service_pb2_grpc.ProposerServiceServicer):
    """Serves after attach(proposer=SpeculativeProposer, info=ModelInfo)."""

    proposer: SpeculativeProposer

    def _core(self) -> SpeculativeProposer:
        return self.proposer

    @map_errors
    async def GetProposals(self, request, context):
        start = time.perf_counter()
        req, missing = self.decode(request.request, self._request_limits())
        if missing:
            return proposer_service_pb2.GetProposalsResponse(missing_seq_ids=missing)
        await self.prepare_grammars(req, required=False)
        proposals = await self.model.run(self.proposer.get_proposals, req)
        response = proposer_service_pb2.GetProposalsResponse(
            proposals=codec.proposals_to_proto(proposals))
        response.service_seconds = time.perf_counter() - start
        return response

    def _request_limits(self) -> ModelInfo:
        # The n-gram proposer checks ids against nothing; the scorer validates them.
        if self.info.vocab_size:
            return self.info
        return ModelInfo(NGRAM, 2**63 - 1, "", self.info.max_model_len)
