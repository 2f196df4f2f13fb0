"""The proposer's entry point (what `specdecode serve proposer` runs)."""

from __future__ import annotations

import logging

from proposer_svc.servicer import ProposerServicer, build_proposer
from specdecode.grammar.metrics import export_grammar_metrics
from specdecode.serving.limits import ServiceLimits
from specdecode.models.model_loading import ModelOptions
from specdecode.serving.runner_upkeep import RunnerUpkeep
from specdecode.serving.server import ServerOptions, serve_deferred
from specdecode.v1 import proposer_service_pb2, proposer_service_pb2_grpc

log = logging.getLogger(__name__)


async def serve_proposer(options: ServerOptions, model: ModelOptions,
                         draft_vocab_size: int = 0,
                         limits: ServiceLimits = ServiceLimits(),
                         draft_confidence: float = 0.0) -> None:
    servicer = ProposerServicer(limits)
    upkeep = RunnerUpkeep(servicer.model)

    def load():
        loaded = build_proposer(model, draft_vocab_size, draft_confidence)
        if loaded.runner is not None:  # a draft model (the n-gram proposer has none)
            upkeep.attach(loaded.runner, loaded.info.forward_cost, "proposer",
                          loaded.cost_cache)
        export_grammar_metrics(loaded.grammars, "proposer")
        log.info("proposer ready: %s", loaded.info)
        return {"proposer": loaded.proposer, "info": loaded.info, "grammars": loaded.grammars}

    def after_serving(_) -> None:
        servicer.keep_leases()
        upkeep.start()
    await serve_deferred(options, proposer_service_pb2,
                         proposer_service_pb2_grpc.add_ProposerServiceServicer_to_server,
                         servicer, load, after_serving=after_serving)
