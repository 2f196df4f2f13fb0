"""Prometheus metrics of the engine's steps: vLLM 0.4.2's acceptance metrics, step phases and
wire bytes (the request metrics are orchestrator.frontend.request_metrics).

Everything here is fed by the engine's step stats (orchestrator.engine.core.StepStats), the one
place acceptance is counted. The acceptance gauges have vLLM 0.4.2's meanings
(draft_acceptance_rate = accepted / draft, system_efficiency = emitted / (speculated
sequences x (k+1)), NaN when a denominator is 0), read at scrape time from the same
AcceptanceTotals that vLLM 0.4.2's AsyncMetricsCollector reads (it logs them every
SPECDECODE_METRICS_LOG_INTERVAL seconds). Labels are bounded: phase, direction, outcome,
role, position <= 16. No request ids.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram

from orchestrator.engine.core import SpecDecodeEngine
from orchestrator.engine.step_stats import StepStats
from orchestrator.engine.spec_metrics import AcceptanceTotals, AsyncMetricsCollector

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
BYTES_BUCKETS = tuple(2 ** i for i in range(8, 28, 2))
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

STEPS = Counter("specdecode_steps", "Decoding steps (propose, score, verify) run.")
DRAFT = Counter("specdecode_draft_tokens", "Draft tokens proposed.")
ACCEPTED = Counter("specdecode_accepted_tokens",
                   "Draft tokens that passed verification (vLLM 0.4.2's accepted_tokens).")
EMITTED = Counter("specdecode_emitted_tokens",
                  "Tokens emitted by speculative steps: accepted prefix plus one per sequence.")
SPEC_SEQUENCES = Counter("specdecode_spec_sequences", "Sequence-steps that speculated.")
ACCEPTED_AT = Counter("specdecode_accepted_tokens_by_position",
                      "How often draft position i was emitted as an accepted token.", ["position"])
MAX_EMITTED = Counter("specdecode_max_emitted_tokens",
                      "Tokens speculative steps could have emitted: sequences x (k+1).")
ACCEPTANCE_RATE = Gauge("specdecode_draft_acceptance_rate",
                        "accepted / draft tokens since start (NaN before any draft).")
EFFICIENCY = Gauge("specdecode_system_efficiency",
                   "emitted / (speculated sequences x (k+1)) since start (NaN before any).")
NUM_SPEC_TOKENS = Gauge("specdecode_num_spec_tokens", "Speculative tokens per step (k): the "
                        "longest any sequence speculated.")
CHOSEN_K = Histogram("specdecode_chosen_k", "Speculation length chosen per sequence and step "
                     "(0 = plain decoding); the adaptive policy picks it from acceptance and "
                     "measured costs. reason: why (speculate, explore, fixed for k > 0; capped, "
                     "low_acceptance, no_match, verify_too_dear, unrealized, no_budget, "
                     "exploration_pending for k = 0).", ["reason"],
                     buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16))
PREDICTED_SPEEDUP = Histogram("specdecode_predicted_speedup", "Per step, the policy's predicted "
                              "tokens/s of the chosen k over plain decoding's (1: plain).",
                              buckets=(0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0))
BATCH = Histogram("specdecode_step_batch_size", "Sequences per step.", buckets=BATCH_BUCKETS)
PHASE = Histogram("specdecode_step_phase_seconds", "Step time by phase: propose, score, "
                  "verify (rejection sampling) and overhead (the rest of the step).", ["phase"],
                  buckets=LATENCY_BUCKETS)
STEP_SECONDS = Histogram("specdecode_step_duration_seconds", "Time of one whole step.",
                         buckets=LATENCY_BUCKETS)
WIRE = Histogram("specdecode_step_wire_bytes", "Bytes on the wire per step, to and from the "
                 "proposer and scorer.", ["direction"], buckets=BYTES_BUCKETS)
SERVICE_WIRE = Counter("specdecode_service_wire_bytes", "Bytes on the wire to and from each "
                       "service.", ["role", "direction"])
SERVICE_BUSY = Histogram("specdecode_step_service_busy_seconds", "Per step, the time each "
                         "service reported working on the step's calls.", ["role"],
                         buckets=LATENCY_BUCKETS)
SERVICE_IDLE = Histogram("specdecode_step_service_idle_seconds", "Per step, the step's time "
                         "minus the service's busy time.", ["role"], buckets=LATENCY_BUCKETS)
FULL_RESENDS = Counter("specdecode_full_resends", "Sequences resent in full within a step "
                       "because the service lacked their prefix (restart, eviction, another "
                       "replica).", ["role"])
CONSTRAINED_DRAFT = Counter("specdecode_constrained_draft_tokens", "Draft tokens proposed for "
                            "sequences under a grammar (structured output).")
CONSTRAINED_ACCEPTED = Counter("specdecode_constrained_accepted_tokens", "Of those, the draft "
                               "tokens that passed verification.")
FORCED = Counter("specdecode_forced_tokens", "Tokens a grammar forced (the only one it "
                 "allowed), emitted by the orchestrator without any forward (jump-forward).")
GRAMMAR_SECONDS = Histogram("specdecode_step_grammar_seconds", "Per step, the orchestrator's "
                            "grammar work (matchers synced, forced-token masks).",
                            buckets=(.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05))
LOOKAHEAD = Counter("specdecode_lookahead_sequences", "Sequence-steps that drafted ahead "
                    "(asynchronous drafting), by outcome: hit (the next proposal was drafted "
                    "from the real prefix and is used) or miss (dropped).", ["outcome"])
LOOKAHEAD_TOKENS = Counter("specdecode_lookahead_tokens", "Tokens drafted ahead, and of those "
                           "wasted (a miss's, or beyond the next step's k).", ["kind"])
RUNNING = Gauge("specdecode_running_sequences", "Sequences in the running batch.")
WAITING = Gauge("specdecode_waiting_requests", "Requests received that have not joined a step "
                "yet (they join at the next step boundary).")
PAUSED = Gauge("specdecode_paused_sequences", "Running sequences paused by back-pressure: "
               "their clients have not taken the outputs waiting (KV state kept).")

class StepMetrics:
    """Called by the engine loop after every step (the step's wire bytes are counted by the
    engine from its remote clients): records the step."""

    def __init__(self, engine: SpecDecodeEngine, log_interval_s: float = 5.0):
        self.engine = engine
        self.totals = AcceptanceTotals()
        self.collector = AsyncMetricsCollector(self.totals, collect_interval_s=log_interval_s,
                                               restart_interval=True)
        self.collector.init_tensors(rank=0)
        # Read at scrape time: a cancelled request leaves the batch without another step.
        RUNNING.set_function(lambda: len(engine.running))
        ACCEPTANCE_RATE.set_function(lambda: self.totals.draft_acceptance_rate)
        EFFICIENCY.set_function(lambda: self.totals.system_efficiency)

    def __call__(self, step: StepStats) -> None:
        self.totals.add(step)
        self.observe(step)
        if step.k and (m := self.collector.maybe_collect_rejsample_metrics(step.k)):
            log.info("speculative metrics: acceptance %.3f, efficiency %.3f, draft %d, "
                     "emitted %d, accepted %d, k %d", m.draft_acceptance_rate,
                     m.system_efficiency, m.draft_tokens, m.emitted_tokens,
                     m.accepted_tokens, m.num_spec_tokens,
                     extra={"fields": {"event": "spec_decode_metrics", **vars(m)}})

    @staticmethod
    def observe(step: StepStats) -> None:
        STEPS.inc()
        DRAFT.inc(step.draft_tokens)
        ACCEPTED.inc(step.accepted_tokens)
        EMITTED.inc(step.emitted_tokens)
        SPEC_SEQUENCES.inc(step.spec_sequences)
        MAX_EMITTED.inc(step.spec_sequences * (step.k + 1))
        for position, count in enumerate(step.accepted_by_position):
            if count:
                ACCEPTED_AT.labels(str(position)).inc(count)
        CONSTRAINED_DRAFT.inc(step.constrained_draft_tokens)
        CONSTRAINED_ACCEPTED.inc(step.constrained_accepted_tokens)
        FORCED.inc(step.forced_tokens)
        if step.grammar_s:
            GRAMMAR_SECONDS.observe(step.grammar_s)
        NUM_SPEC_TOKENS.set(step.k)
        for k, reason in zip(step.chosen_k, step.k_reasons or [""] * len(step.chosen_k)):
            CHOSEN_K.labels(reason).observe(k)
        PREDICTED_SPEEDUP.observe(step.predicted_speedup)
        BATCH.observe(step.batch_size)
        STEP_SECONDS.observe(step.total_s)
        overhead = step.total_s - step.propose_s - step.score_s - step.verify_s
        for phase, seconds in (("propose", step.propose_s), ("score", step.score_s),
                               ("verify", step.verify_s), ("overhead", overhead)):
            PHASE.labels(phase).observe(max(seconds, 0.0))
        if step.lookahead_hits or step.lookahead_misses:
            LOOKAHEAD.labels("hit").inc(step.lookahead_hits)
            LOOKAHEAD.labels("miss").inc(step.lookahead_misses)
            LOOKAHEAD_TOKENS.labels("drafted").inc(step.lookahead_drafted)
        LOOKAHEAD_TOKENS.labels("wasted").inc(step.lookahead_wasted)
        WIRE.labels("sent").observe(step.bytes_sent)
        WIRE.labels("received").observe(step.bytes_received)
        for role, service in step.services.items():
            SERVICE_WIRE.labels(role, "sent").inc(service.bytes_sent)
            SERVICE_WIRE.labels(role, "received").inc(service.bytes_received)
            SERVICE_BUSY.labels(role).observe(service.busy_s)
            SERVICE_IDLE.labels(role).observe(service.idle_s)
            FULL_RESENDS.labels(role).inc(service.full_resends)
