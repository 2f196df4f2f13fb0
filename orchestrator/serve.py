"""The orchestrator's entry point (what `specdecode serve orchestrator` runs): composes the
cluster (the services' replicas), the engine and the frontend (both public APIs) from one
OrchestratorConfig. The proposer's and the scorer's are proposer_svc.serve and scorer_svc.serve.

It imports the orchestrator's modules when it runs, so that a process's /metrics lists only
the metrics of its role (the orchestrator's step metrics are not registered in the proposer,
and so on)."""

from __future__ import annotations

import asyncio
import logging
import os

from orchestrator.config import OrchestratorConfig
from specdecode.serving.server import serve_deferred
from specdecode.v1 import spec_decode_service_pb2, spec_decode_service_pb2_grpc

log = logging.getLogger(__name__)


def _load(config: OrchestratorConfig, parts: dict) -> dict:
    """Connect to both services' replicas and check them (ServiceUnreachableError or
    IncompatibleModelsError end the process before it reports SERVING), then start the
    engine loop; what the servicer serves."""
    from orchestrator.cluster.fanout import connect_services
    from orchestrator.engine.build import build_engine
    from orchestrator.engine.loop import EngineLoop
    from orchestrator.engine.step_metrics import PAUSED, WAITING, StepMetrics
    from orchestrator.frontend.chat_template import message_overhead
    from orchestrator.frontend.generation import ServedModel
    from orchestrator.frontend.request import RequestLimits
    from specdecode.grammar.matcher import Grammars
    from specdecode.grammar.metrics import export_grammar_metrics
    from specdecode.model_info import (check_compatible, check_tokenizer, serving_max_model_len,
                                       share_cores)
    from specdecode.models.checkpoints import load_tokenizer, tokenizer_fingerprint

    proposer, scorer, p_info, s_info = connect_services(
        config.proposer, config.scorer, config.server.channel_options, config.resilience,
        config.connect_timeout_s, config.security, config.sequence_deltas)
    parts["services"] = (proposer, scorer)
    check_compatible(p_info, s_info)
    tok = None
    if config.tokenizer != "none":
        tok = load_tokenizer(None if config.tokenizer == "default" else config.tokenizer)
        check_tokenizer(tokenizer_fingerprint(tok), s_info)
    k, admission = config.num_speculative_tokens, config.admission
    compiler = _grammar_compiler(tok, s_info, config.grammar_compile_timeout_s)
    engine = build_engine(
        proposer, scorer, k=k, adaptive=config.speculation == "adaptive",
        scoring=s_info.scoring_method, draft_model=p_info.is_draft_model,
        scorer_costs=s_info.forward_cost, draft_costs=p_info.forward_cost,
        max_model_len=serving_max_model_len(p_info, s_info), trace_every=config.trace_every,
        max_num_batched_tokens=admission.max_num_batched_tokens, overlap=config.overlap,
        grammars=None if isinstance(compiler, str) else Grammars(compiler),
        async_drafting=config.async_drafting, share_cores=share_cores(p_info, s_info))
    if engine.policy.adaptive:  # the services' re-measured tables replace the start-up ones
        from orchestrator.cluster.cost_refresh import CostRefresh
        parts["refresh"] = CostRefresh.started(engine.policy, {"proposer": (proposer, p_info),
                                                               "scorer": (scorer, s_info)})
    log_interval = float(os.environ.get("SPECDECODE_METRICS_LOG_INTERVAL", 5.0))
    parts["loop"] = loop = EngineLoop(engine, on_step=StepMetrics(engine, log_interval),
                                      max_running=admission.max_running)
    WAITING.set_function(lambda: loop.waiting)
    PAUSED.set_function(lambda: loop.paused)
    export_grammar_metrics(engine.grammars, "orchestrator")
    loop.start()
    log.info("orchestrator ready (id %010x): proposer %s, scorer %s", engine.orchestrator_id,
             p_info.model_name, s_info.model_name)
    info = ServedModel(model_name=config.served_model_name or s_info.model_name,
                       target_model_name=s_info.model_name, draft_model_name=p_info.model_name,
                       vocab_size=s_info.vocab_size, max_model_len=engine.max_model_len,
                       num_speculative_tokens=k, scoring_method=s_info.scoring_method,
                       has_tokenizer=tok is not None)
    cap = engine.max_model_len - 1
    limits = RequestLimits(engine.max_model_len, min(admission.max_prompt_tokens or cap, cap), k,
                           s_info.vocab_size, admission.default_max_tokens, tok is not None,
                           *message_overhead(tok))  # the chat template's part per message
    return {"loop": loop, "tokenizer": tok, "info": info, "limits": limits,
            "grammars": compiler}


def _grammar_compiler(tokenizer, scorer, timeout_s: float):
    """The orchestrator's grammar compiler (structured output: requests are compiled within
    timeout_s, forced tokens found for jump-forward), or why the server cannot serve them."""
    from specdecode.grammar.compiler import GrammarCompiler

    if tokenizer is None:
        return "this server has no tokenizer (--tokenizer none)"
    if not scorer.structured_output:
        return f"the scorer ({scorer.model_name}) builds no grammar masks (it has no tokenizer)"
    return GrammarCompiler(tokenizer, scorer.vocab_size, timeout_s)


async def serve_orchestrator(config: OrchestratorConfig) -> None:
    """Serve both public APIs until SIGTERM.

    Health follows the scorer: NOT_SERVING while no scorer replica is up. On SIGTERM,
    requests still running shortly before the grace ends finish as "cancelled" and their
    sequences are released on the services. The OpenAI-compatible HTTP API (http_port) on
    the same host answers 503 until the services are checked, and drains with the gRPC
    server."""
    from orchestrator.frontend.admission import Admission
    from orchestrator.frontend.servicer import SpecDecodeServicer

    parts: dict = {}
    servicer = SpecDecodeServicer(Admission(config.admission.max_running,
                                            config.admission.max_queued),
                                  config.stream_write_timeout_s)

    def follow_scorer(server) -> None:
        """One health for both APIs: gRPC's status and HTTP /health's reason together."""
        loop = asyncio.get_running_loop()
        scorers = parts["services"][1].replicas

        def on_change(up: int) -> None:
            servicer.frontend.unavailable = None if up else \
                f"no scorer replica is up ({config.scorer})"
            asyncio.run_coroutine_threadsafe(server.set_serving(up > 0), loop)
        scorers.listeners.append(on_change)
        on_change(scorers.up_count())

    async def cancel_before_grace_ends(grace_s: float) -> None:
        servicer.frontend.unavailable = "draining (shutting down)"  # as gRPC's NOT_SERVING
        await asyncio.sleep(max(0.0, grace_s - min(1.0, grace_s / 4)))
        log.warning("grace period ending: cancelling the requests still running")
        servicer.frontend.cancel_all()

    options = config.server
    companions = []
    if config.http_port:
        from orchestrator.frontend.http_server import HttpServer
        from orchestrator.frontend.openai_api import create_app
        from specdecode.serving.auth import TokenSet
        tokens = TokenSet(options.auth_token_file) if options.auth_token_file else None
        # A JSON body may spell a prompt less tightly than protobuf: twice its byte limit.
        app = create_app(servicer.frontend, tokens,
                         max_body_bytes=2 * config.admission.max_request_bytes)
        companions.append(HttpServer(app, options.host, config.http_port,
                                     options.grace_seconds, options.tls, config.http,
                                     config.stream_write_timeout_s))
    try:
        await serve_deferred(options, spec_decode_service_pb2,
                             spec_decode_service_pb2_grpc.add_SpecDecodeServiceServicer_to_server,
                             servicer, lambda: _load(config, parts), start_traces=True,
                             after_serving=follow_scorer, on_drain=cancel_before_grace_ends,
                             companions=companions)
    finally:
        if "refresh" in parts:
            parts["refresh"].close()
        if "loop" in parts:
            parts["loop"].stop()
        for service in parts.get("services", ()):
            service.close()
