"""The orchestrator's entry point (what `specdecode serve orchestrator` runs). The proposer's
and the scorer's are proposer_svc.serve and scorer_svc.serve.

It imports the orchestrator's modules when it runs, so that a process's /metrics lists only
the metrics of its role (the orchestrator's step metrics are not registered in the proposer,
and so on)."""

from __future__ import annotations

import asyncio
import logging
import os

from orchestrator.frontend.admission import AdmissionConfig
from orchestrator.engine.deadlines import ResilienceOptions
from orchestrator.cluster.remote import ServiceSecurity
from specdecode.server import ServerOptions, serve_deferred
from specdecode.v1 import spec_decode_service_pb2, spec_decode_service_pb2_grpc

log = logging.getLogger(__name__)


async def serve_orchestrator(options: ServerOptions, proposer_address: str, scorer_address: str,
                             tokenizer: str | None, num_speculative_tokens: int,
                             connect_timeout_s: float = 60.0,
                             default_max_tokens: int = 256, trace_every: int = 1,
                             resilience: ResilienceOptions = ResilienceOptions(),
                             speculation: str = "adaptive", http_port: int = 0, *,
                             security: ServiceSecurity = ServiceSecurity(),
                             admission: AdmissionConfig = AdmissionConfig(),
                             sequence_deltas: bool = True, overlap: bool = False) -> None:
    """Connect to both services' replicas and check them (ServiceUnreachableError or
    IncompatibleModelsError end the process before it reports SERVING), then serve.
    trace_every: keep every Nth step span (1 = all, 0 = request spans only).
    speculation: adaptive (k per sequence and step from the services' measured costs,
    num_speculative_tokens the most) or fixed (every sequence speculates that k).

    Health follows the scorer: NOT_SERVING while no scorer replica is up. On SIGTERM,
    requests still running shortly before the grace ends finish as "cancelled" and their
    sequences are released on the services.

    http_port: the OpenAI-compatible HTTP API's port on the same host (0 = off); it answers
    503 until the services are checked, and drains with the gRPC server.
    security: how to reach the services (mutual TLS, or a bearer token).
    admission: request limits, concurrency and the per-step token budget (both APIs)."""
    from orchestrator.frontend.admission import Admission, RequestLimits
    from orchestrator.engine.core import SpecDecodeEngine
    from orchestrator.engine.loop import EngineLoop
    from orchestrator.cluster.fanout import connect_services
    from orchestrator.engine.step_metrics import WAITING, StepMetrics
    from orchestrator.frontend.generation import ServedModel
    from orchestrator.frontend.servicer import SpecDecodeServicer
    from orchestrator.engine.speculation_policy import SpeculationPolicy
    from specdecode.model_info import check_compatible, check_tokenizer, serving_max_model_len
    from specdecode.models import load_tokenizer, tokenizer_fingerprint

    parts: dict = {}
    servicer = SpecDecodeServicer(default_max_tokens, num_speculative_tokens,
                                  Admission(admission.max_running, admission.max_queued))

    def load():
        proposer, scorer, p_info, s_info = connect_services(
            proposer_address, scorer_address, options.channel_options, resilience,
            connect_timeout_s, security, sequence_deltas)
        parts["services"] = (proposer, scorer)
        check_compatible(p_info, s_info)
        tok = None
        if tokenizer != "none":
            tok = load_tokenizer(None if tokenizer == "default" else tokenizer)
            check_tokenizer(tokenizer_fingerprint(tok), s_info)
        policy = SpeculationPolicy(
            num_speculative_tokens, adaptive=speculation == "adaptive",
            scorer_costs=s_info.forward_cost, draft_costs=p_info.forward_cost,
            draft_model=p_info.vocab_size > 0, scoring=s_info.scoring_method)
        if speculation == "adaptive" and not policy.adaptive:
            log.warning("the services report no forward costs: speculating a fixed k=%d",
                        num_speculative_tokens)
        engine = SpecDecodeEngine(proposer, scorer, vocab_size=s_info.vocab_size,
                                  max_model_len=serving_max_model_len(p_info, s_info),
                                  num_speculative_tokens=num_speculative_tokens,
                                  trace_every=trace_every, policy=policy,
                                  max_num_batched_tokens=admission.max_num_batched_tokens,
                                  overlap=overlap)
        log_interval = float(os.environ.get("SPECDECODE_METRICS_LOG_INTERVAL", 5.0))
        parts["loop"] = EngineLoop(engine, on_step=StepMetrics(engine, log_interval),
                                   max_running=admission.max_running)
        WAITING.set_function(lambda: parts["loop"].waiting)
        parts["loop"].start()
        log.info("orchestrator ready (id %010x): proposer %s, scorer %s", engine.orchestrator_id,
                 p_info.model_name, s_info.model_name)
        info = ServedModel(
            model_name=s_info.model_name, draft_model_name=p_info.model_name,
            vocab_size=s_info.vocab_size, max_model_len=engine.max_model_len,
            num_speculative_tokens=num_speculative_tokens,
            max_speculative_tokens=servicer.frontend.max_speculative_tokens,
            scoring_method=s_info.scoring_method, has_tokenizer=tok is not None)
        limits = RequestLimits.for_model(admission, engine.max_model_len, num_speculative_tokens)
        return {"loop": parts["loop"], "tokenizer": tok, "info": info, "limits": limits}

    def follow_scorer(server) -> None:
        loop = asyncio.get_running_loop()
        scorers = parts["services"][1].replicas

        def on_change(up: int) -> None:
            asyncio.run_coroutine_threadsafe(server.set_serving(up > 0), loop)
        scorers.listeners.append(on_change)
        on_change(scorers.up_count())

    async def cancel_before_grace_ends(grace_s: float) -> None:
        await asyncio.sleep(max(0.0, grace_s - min(1.0, grace_s / 4)))
        log.warning("grace period ending: cancelling the requests still running")
        servicer.frontend.cancel_all()

    companions = []
    if http_port:
        from orchestrator.frontend.http_server import HttpServer
        from orchestrator.frontend.openai_api import create_app
        from specdecode.auth import TokenSet
        tokens = TokenSet(options.auth_token_file) if options.auth_token_file else None
        # A JSON body may spell a prompt less tightly than protobuf: twice its byte limit.
        app = create_app(servicer.frontend, lambda: servicer.info if servicer.loaded else None,
                         tokens, max_body_bytes=2 * admission.max_request_bytes)
        companions.append(HttpServer(app, options.host, http_port, options.grace_seconds,
                                     options.tls))
    try:
        await serve_deferred(options, spec_decode_service_pb2,
                             spec_decode_service_pb2_grpc.add_SpecDecodeServiceServicer_to_server,
                             servicer, load, start_traces=True, after_serving=follow_scorer,
                             on_drain=cancel_before_grace_ends, companions=companions)
    finally:
        if "loop" in parts:
            parts["loop"].stop()
        for service in parts.get("services", ()):
            service.close()
