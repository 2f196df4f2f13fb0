"""ScorerService: protobuf in, dataclasses to the scorer, protobuf out."""

from __future__ import annotations

import time
from dataclasses import dataclass

from scorer_svc.methods import SCORING_CHOICES, make_scorer
from specdecode.wire import codec
from specdecode.executor.calibration import calibration_widths
from specdecode.executor.cost_cache import CostCache, calibrate_or_reuse, cost_cache
from specdecode.interfaces import SpeculativeScorer
from specdecode.model_info import ModelInfo
from specdecode.grammar.matcher import Grammars
from specdecode.models.checkpoints import resolve_model_dir
from specdecode.models.model_loading import ModelOptions, load_grammars, load_runner, model_info_for
from specdecode.executor.model_runner import ModelRunner
from specdecode.errors import fields_of
from specdecode.serving.model_servicer import ModelServicer
from specdecode.serving.server import map_errors
from specdecode.v1 import scorer_service_pb2, scorer_service_pb2_grpc
from specdecode.executor.worker import ModelWorker


@dataclass(frozen=True)
class LoadedScorer:
    scorer: SpeculativeScorer
    info: ModelInfo
    runner: ModelRunner  # the target model's
    grammars: Grammars | None  # None: the model has no tokenizer (no structured output)
    cost_cache: CostCache | None = None  # where its forward-cost table is kept


def build_scorer(options: ModelOptions, scoring: str) -> LoadedScorer:
    """The target model loaded from `options`, its forward costs measured (calibration.
    calibrate) or kept from an earlier start (cost_cache), scored by the method named
    `scoring` (auto: per call, by cost)."""
    if scoring not in SCORING_CHOICES:
        raise ValueError(f"scoring: must be one of {', '.join(SCORING_CHOICES)}, got {scoring!r}")
    runner, fingerprint = load_runner(options)
    cache = cost_cache(options.cost_cache, resolve_model_dir(options.model), "scorer", options,
                       device=str(runner.device))
    costs = calibrate_or_reuse(runner, cache, calibration_widths(options.calibration_width))
    grammars = load_grammars(options, runner.vocab_size, runner.max_cached_sequences)
    info = model_info_for(runner, options, fingerprint, role="scorer",
                          scoring_method=scoring, forward_cost=costs,
                          structured_output=grammars is not None)
    worker = ModelWorker(runner, "target", grammars)
    return LoadedScorer(make_scorer(scoring, worker, costs), info, runner, grammars, cache)


class ScorerServicer(ModelServicer, scorer_service_pb2_grpc.ScorerServiceServicer):
    """Serves after attach(scorer=SpeculativeScorer, info=ModelInfo)."""

    scorer: SpeculativeScorer

    def _core(self) -> SpeculativeScorer:
        return self.scorer

    @map_errors
    async def ScoreProposals(self, request, context):
        start = time.perf_counter()
        req, missing = self.decode(request.request, self.info)
        if missing:
            return scorer_service_pb2.ScoreProposalsResponse(missing_seq_ids=missing)
        await self.prepare_grammars(req, required=True)
        proposals = codec.proposals_from_proto(request.proposals, "proposals",
                                               batch_size=len(req.seq_group_metadata_list),
                                               vocab_size=self.info.vocab_size)
        with fields_of("proposals"):
            proposals.validate(req, self.info.vocab_size, self.info.max_model_len)
        scores = await self.model.run(self.scorer.score_proposals, req, proposals)
        if scores.logprobs is not None:  # rows nobody asked for travel as zeros (sparse)
            asked = [sg.sampling_params.logprobs is not None for sg in req.seq_group_metadata_list]
            scores.logprobs[[i for i, a in enumerate(asked) if not a]] = 0.0
        response = scorer_service_pb2.ScoreProposalsResponse(scores=codec.scores_to_proto(scores))
        response.service_seconds = time.perf_counter() - start
        return response
