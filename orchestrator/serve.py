"""Entry points of the three servers (what `specdecode serve ...` runs).

Each role imports only its own modules, so a process's /metrics lists only the metrics of
its role (the orchestrator's step metrics are not registered in the proposer, and so on).
"""

from __future__ import annotations

import asyncio
import logging
import os

from specdecode.model_service import ModelOptions, export_runner_metrics
from specdecode.server import Deferred, GrpcServer, ServerOptions
from specdecode.v1 import (proposer_service_pb2, proposer_service_pb2_grpc, scorer_service_pb2,
                           scorer_service_pb2_grpc, spec_decode_service_pb2,
                           spec_decode_service_pb2_grpc)

log = logging.getLogger(__name__)


def _service_name(module) -> str:
    (service,) = module.DESCRIPTOR.services_by_name.values()
    return service.full_name


async def _serve(options: ServerOptions, service_module, add, servicer: Deferred, load,
                 start_traces: bool = False) -> None:
    """Serve with health NOT_SERVING while `load` runs (in a thread), attach what it
    returns, report SERVING, and drain on SIGTERM. Only the public API starts traces; the
    proposer and scorer continue their caller's."""
    server = GrpcServer(options, [_service_name(service_module)], start_traces=start_traces)
    add(servicer, server.server)
    await server.start()
    try:
        servicer.attach(**await asyncio.to_thread(load))
    except BaseException:
        await server.server.stop(None)
        raise
    await server.set_serving()
    await server.wait_for_termination()


async def serve_proposer(options: ServerOptions, model: ModelOptions) -> None:
    from proposer_svc.servicer import ProposerServicer, build_proposer

    def load():
        proposer, info = build_proposer(model)
        if hasattr(proposer, "worker"):  # a draft model (the n-gram proposer has none)
            export_runner_metrics(proposer.worker.runner, "proposer")
        log.info("proposer ready: %s", info)
        return {"proposer": proposer, "info": info}
    await _serve(options, proposer_service_pb2,
                 proposer_service_pb2_grpc.add_ProposerServiceServicer_to_server,
                 ProposerServicer(), load)


async def serve_scorer(options: ServerOptions, model: ModelOptions, scoring: str) -> None:
    from scorer_svc.servicer import ScorerServicer, build_scorer

    def load():
        scorer, info = build_scorer(model, scoring)
        export_runner_metrics(scorer.worker.runner, "scorer")
        log.info("scorer ready: %s", info)
        return {"scorer": scorer, "info": info}
    await _serve(options, scorer_service_pb2,
                 scorer_service_pb2_grpc.add_ScorerServiceServicer_to_server,
                 ScorerServicer(), load)


async def serve_orchestrator(options: ServerOptions, proposer_address: str, scorer_address: str,
                             tokenizer: str | None, num_speculative_tokens: int,
                             connect_timeout_s: float = 60.0,
                             default_max_tokens: int = 256, trace_every: int = 1) -> None:
    """Connect to both services and check them (ServiceUnreachableError or
    IncompatibleModelsError end the process before it reports SERVING), then serve.
    trace_every: keep every Nth step span (1 = all, 0 = request spans only)."""
    from orchestrator.engine import SpecDecodeEngine
    from orchestrator.engine_loop import EngineLoop
    from orchestrator.metrics import StepMetrics
    from orchestrator.remote import RemoteProposer, RemoteScorer, connect
    from orchestrator.servicer import SpecDecodeServicer
    from specdecode.model_info import check_compatible, check_tokenizer, serving_max_model_len
    from specdecode.models import load_tokenizer, tokenizer_fingerprint

    loops: list[EngineLoop] = []

    def load():
        channels = options.channel_options
        proposer = RemoteProposer(
            connect("proposer", proposer_address, channels, connect_timeout_s),
            address=proposer_address)
        scorer = RemoteScorer(connect("scorer", scorer_address, channels, connect_timeout_s),
                              address=scorer_address)
        p_info, s_info = proposer.model_info(), scorer.model_info()
        check_compatible(p_info, s_info)
        tok = None
        if tokenizer != "none":
            tok = load_tokenizer(None if tokenizer == "default" else tokenizer)
            check_tokenizer(tokenizer_fingerprint(tok), s_info)
        engine = SpecDecodeEngine(proposer, scorer, vocab_size=s_info.vocab_size,
                                  max_model_len=serving_max_model_len(p_info, s_info),
                                  num_speculative_tokens=num_speculative_tokens,
                                  trace_every=trace_every)
        log_interval = float(os.environ.get("SPECDECODE_METRICS_LOG_INTERVAL", 5.0))
        loops.append(EngineLoop(engine, on_step=StepMetrics(engine, log_interval)))
        loops[0].start()
        log.info("orchestrator ready: proposer %s, scorer %s", p_info.model_name, s_info.model_name)
        return {"loop": loops[0], "tokenizer": tok}

    try:
        await _serve(options, spec_decode_service_pb2,
                     spec_decode_service_pb2_grpc.add_SpecDecodeServiceServicer_to_server,
                     SpecDecodeServicer(default_max_tokens), load, start_traces=True)
    finally:
        for loop in loops:
            loop.stop()
