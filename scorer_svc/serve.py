"""The scorer's entry point (what `specdecode serve scorer` runs)."""

from __future__ import annotations

import logging

from scorer_svc.servicer import ScorerServicer, build_scorer
from specdecode.grammar.metrics import export_grammar_metrics
from specdecode.serving.limits import ServiceLimits
from specdecode.models.model_loading import ModelOptions
from specdecode.serving.runner_upkeep import RunnerUpkeep
from specdecode.serving.server import ServerOptions, serve_deferred
from specdecode.v1 import scorer_service_pb2, scorer_service_pb2_grpc

log = logging.getLogger(__name__)


async def serve_scorer(options: ServerOptions, model: ModelOptions, scoring: str,
                       limits: ServiceLimits = ServiceLimits()) -> None:
    servicer = ScorerServicer(limits)
    upkeep = RunnerUpkeep(servicer.model)

    def load():
        loaded = build_scorer(model, scoring)
        upkeep.attach(loaded.runner, loaded.info.forward_cost, "scorer", loaded.cost_cache)
        export_grammar_metrics(loaded.grammars, "scorer")
        log.info("scorer ready: %s", loaded.info)
        return {"scorer": loaded.scorer, "info": loaded.info, "grammars": loaded.grammars}

    def after_serving(_) -> None:
        servicer.keep_leases()
        upkeep.start()
    await serve_deferred(options, scorer_service_pb2,
                         scorer_service_pb2_grpc.add_ScorerServiceServicer_to_server,
                         servicer, load, after_serving=after_serving)
