"""Prometheus metrics of public requests: outcomes, tokens in and out, latencies (both APIs
feed them through orchestrator.frontend.generation). Labels are bounded: outcome only."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from orchestrator.engine.step_metrics import LATENCY_BUCKETS

REQUESTS = Counter("specdecode_requests", "Requests finished, by outcome.", ["outcome"])
GENERATED = Counter("specdecode_generation_tokens", "Tokens returned to clients.")
PROMPT = Counter("specdecode_prompt_tokens", "Prompt tokens received.")
TTFT = Histogram("specdecode_time_to_first_token_seconds", "Time to the first token.",
                 buckets=LATENCY_BUCKETS)
ITL = Histogram("specdecode_inter_token_latency_seconds",
                "Time between streamed messages, per token they carry.", buckets=LATENCY_BUCKETS)
TPOT = Histogram("specdecode_time_per_output_token_seconds",
                 "Per request: the time after its first token over the tokens after it "
                 "(vLLM's request_time_per_output_token).", buckets=LATENCY_BUCKETS)
E2E = Histogram("specdecode_e2e_request_latency_seconds", "Request time, end to end.",
                buckets=LATENCY_BUCKETS)

