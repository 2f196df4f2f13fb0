"""The scorer's entry point (what `specdecode serve scorer` runs)."""

from __future__ import annotations

import logging

from scorer_svc.servicer import ScorerServicer, build_scorer
from specdecode.executor.calibration import attach_live_costs
from specdecode.executor.compile_mode import BackgroundCompile
from specdecode.grammar.metrics import export_grammar_metrics
from specdecode.serving.limits import ServiceLimits
from specdecode.models.model_loading import ModelOptions
from specdecode.serving.model_metrics import export_runner_metrics
from specdecode.serving.recalibration import Recalibrator
from specdecode.serving.server import ServerOptions, serve_deferred
from specdecode.v1 import scorer_service_pb2, scorer_service_pb2_grpc

log = logging.getLogger(__name__)


async def serve_scorer(options: ServerOptions, model: ModelOptions, scoring: str,
                       limits: ServiceLimits = ServiceLimits()) -> None:
    servicer = ScorerServicer(limits)
    recalibrator: list[Recalibrator] = []
    compiling: list[BackgroundCompile] = []

    def load():
        loaded = build_scorer(model, scoring)
        export_runner_metrics(loaded.runner, "scorer")
        attach_live_costs(loaded.runner, loaded.info.forward_cost)
        export_grammar_metrics(loaded.grammars, "scorer")
        recalibrator.append(Recalibrator(loaded.runner, loaded.info.forward_cost, servicer.model))
        if BackgroundCompile.needed(loaded.runner):
            compiling.append(BackgroundCompile(loaded.runner))
        log.info("scorer ready: %s", loaded.info)
        return {"scorer": loaded.scorer, "info": loaded.info, "grammars": loaded.grammars}

    def after_serving(_) -> None:
        servicer.keep_leases()
        recalibrator[0].start()
        for c in compiling:
            c.start()
    await serve_deferred(options, scorer_service_pb2,
                         scorer_service_pb2_grpc.add_ScorerServiceServicer_to_server,
                         servicer, load, after_serving=after_serving)
