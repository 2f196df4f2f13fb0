"""The orchestrator's entry point (what `specdecode serve orchestrator` runs). The proposer's
and the scorer's are proposer_svc.serve and scorer_svc.serve.

It imports the orchestrator's modules when it runs, so that a process's /metrics lists only
the metrics of its role (the orchestrator's step metrics are not registered in the proposer,
and so on)."""

from __future__ import annotations

import logging
import os

from specdecode.server import ServerOptions, serve_deferred
from specdecode.v1 import spec_decode_service_pb2, spec_decode_service_pb2_grpc

log = logging.getLogger(__name__)


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
        await serve_deferred(options, spec_decode_service_pb2,
                             spec_decode_service_pb2_grpc.add_SpecDecodeServiceServicer_to_server,
                             SpecDecodeServicer(default_max_tokens), load, start_traces=True)
    finally:
        for loop in loops:
            loop.stop()
