"""ScorerService: protobuf in, dataclasses to the scorer, protobuf out."""

from __future__ import annotations

import time
from dataclasses import dataclass

from scorer_svc.methods import SCORING_CHOICES, make_scorer
from specdecode import wire
from specdecode.cost_model import calibrate, calibration_widths
from specdecode.interfaces import SpeculativeScorer
from specdecode.model_info import ModelInfo
from specdecode.model_loading import ModelOptions, load_runner, model_info_for
from specdecode.model_runner import ModelRunner
from specdecode.model_servicer import ModelServicer, decode_request
from specdecode.errors import InvalidRequestError
from specdecode.server import map_errors
from specdecode.v1 import scorer_service_pb2, scorer_service_pb2_grpc
from specdecode.worker import ModelWorker


@dataclass(frozen=True)
class LoadedScorer:
    scorer: SpeculativeScorer
    info: ModelInfo
    runner: ModelRunner  # the target model's


def build_scorer(options: ModelOptions, scoring: str) -> LoadedScorer:
    """The target model loaded from `options`, its forward costs measured
    (cost_model.calibrate), scored by the method named `scoring` (auto: per call, by cost)."""
    if scoring not in SCORING_CHOICES:
        raise ValueError(f"scoring: must be one of {', '.join(SCORING_CHOICES)}, got {scoring!r}")
    runner, fingerprint = load_runner(options)
    costs = calibrate(runner, tokens=calibration_widths(options.calibration_width))
    info = model_info_for(runner, options, fingerprint, role="scorer",
                          scoring_method=scoring, forward_cost=costs)
    return LoadedScorer(make_scorer(scoring, ModelWorker(runner, "target"), costs), info, runner)


class ScorerServicer(ModelServicer, scorer_service_pb2_grpc.ScorerServiceServicer):
    """Serves after attach(scorer=SpeculativeScorer, info=ModelInfo)."""

    scorer: SpeculativeScorer

    def _core(self) -> SpeculativeScorer:
        return self.scorer

    @map_errors
    async def ScoreProposals(self, request, context):
        start = time.perf_counter()
        req, missing = decode_request(request.request, self.info, self.sequences, self.limits)
        if missing:
            return scorer_service_pb2.ScoreProposalsResponse(missing_seq_ids=missing)
        proposals = wire.proposals_from_proto(request.proposals, "proposals",
                                              batch_size=len(req.seq_group_metadata_list),
                                              vocab_size=self.info.vocab_size)
        ids = proposals.proposal_token_ids
        if ids.shape[1] != req.num_lookahead_slots:
            raise InvalidRequestError("proposals.proposal_token_ids",
                                      f"has {ids.shape[1]} columns, num_lookahead_slots is "
                                      f"{req.num_lookahead_slots}")
        if ((ids < -1) | (ids >= self.info.vocab_size)).any():
            raise InvalidRequestError("proposals.proposal_token_ids",
                                      f"ids outside the vocabulary [0, {self.info.vocab_size})")
        scores = await self.model.run(self.scorer.score_proposals, req, proposals)
        if scores.logprobs is not None:  # rows nobody asked for travel as zeros (sparse)
            asked = [sg.sampling_params.logprobs is not None for sg in req.seq_group_metadata_list]
            scores.logprobs[[i for i, a in enumerate(asked) if not a]] = 0.0
        response = scorer_service_pb2.ScoreProposalsResponse(scores=wire.scores_to_proto(scores))
        response.service_seconds = time.perf_counter() - start
        return response
