"""One step's statistics, counted by the step itself (vLLM v1's SpecDecodingStats.observe_draft
is the model): the one place acceptance is counted. The Prometheus metrics
(orchestrator.engine.step_metrics), vLLM 0.4.2's collector and the step span all read it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from orchestrator.engine.lookahead import AheadStats
from orchestrator.engine.service_stats import ServiceStats


@dataclass
class StepStats:
    batch_size: int = 0
    k: int = 0  # the step's longest speculation (num_lookahead_slots)
    chosen_k: list[int] = field(default_factory=list)  # [B] speculation length per sequence
    predicted_scoring: str = ""  # the scoring method the policy's costs predicted ("": none)
    explore: bool = False  # the policy speculated to measure a cost, not because it pays
    # [B] why each sequence got its k (speculation_policy.REASONS; a proposal asked for but
    # not found is "no_match"), and the policy's predicted tokens/s of the chosen ks over
    # plain decoding's (1: plain), and of its best speculative plan's.
    k_reasons: list[str] = field(default_factory=list)
    predicted_speedup: float = 1.0
    best_speculative_speedup: float = 1.0
    draft_tokens: int = 0
    # Draft tokens that passed the accept test, even after an earlier rejection in their row
    # (vLLM 0.4.2's accepted_tokens: an alignment measure; may exceed what was emitted).
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # accepted prefix + 1, summed over speculating sequences
    spec_sequences: int = 0
    # [k]: how many sequences emitted draft position j as an accepted token.
    accepted_by_position: list[int] = field(default_factory=list)
    # The same counts for sequences under a grammar (structured output), and the tokens a
    # grammar forced after the step's tokens (emitted with no forward at all: jump-forward).
    constrained_draft_tokens: int = 0
    constrained_accepted_tokens: int = 0
    forced_tokens: int = 0
    grammar_s: float = 0.0  # the engine's grammar work: syncing matchers, forced-token masks
    new_tokens: int = 0  # tokens appended to outputs (after stop rules)
    finished: int = 0  # sequences that finished this step
    propose_s: float = 0.0
    score_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    # Drafting ahead (orchestrator.engine.lookahead): rows settled as hits / misses, tokens
    # drafted ahead and dropped, rows whose proposals were drafted ahead, and the seconds
    # the step waited for its lookahead after its tokens were known.
    lookahead_hits: int = 0
    lookahead_misses: int = 0
    lookahead_drafted: int = 0
    lookahead_wasted: int = 0
    lookahead_ready: int = 0
    lookahead_wait_s: float = 0.0
    bytes_sent: int = 0  # to the proposer and scorer (remote services only)
    bytes_received: int = 0
    services: dict[str, ServiceStats] = field(default_factory=dict)  # by role

    def observe_draft(self, proposed: int, passed: int, emitted: int,
                      constrained: bool = False) -> None:
        """A speculating sequence: `proposed` draft tokens, `passed` of them passed the
        accept test, `emitted` tokens emitted (its accepted prefix + 1); `constrained`: it
        follows a grammar."""
        if constrained:
            self.constrained_draft_tokens += proposed
            self.constrained_accepted_tokens += passed
        self.draft_tokens += proposed
        self.accepted_tokens += passed
        self.emitted_tokens += emitted
        self.spec_sequences += 1
        for j in range(emitted - 1):
            self.accepted_by_position[j] += 1

    def observe_lookahead(self, ahead: AheadStats) -> None:
        self.lookahead_hits, self.lookahead_misses = ahead.hits, ahead.misses
        self.lookahead_drafted, self.lookahead_wasted = ahead.drafted, ahead.wasted
        self.lookahead_ready, self.lookahead_wait_s = ahead.ready, ahead.wait_s

    def observe_services(self, services: dict[str, ServiceStats]) -> None:
        self.services = services
        self.bytes_sent = sum(s.bytes_sent for s in services.values())
        self.bytes_received = sum(s.bytes_received for s in services.values())

    def span_attributes(self) -> dict:
        """Every count as a `specdecode.*` step span attribute (services by role)."""
        skip = {"services", "accepted_by_position", "propose_s", "score_s", "verify_s",
                "total_s", "bytes_sent", "bytes_received", "lookahead_wait_s"}
        attrs = {f"specdecode.{f.name}": getattr(self, f.name) for f in fields(self)
                 if f.name not in skip}
        attrs["specdecode.predicted_scoring"] = self.predicted_scoring or None
        attrs["specdecode.wire.bytes_sent"] = self.bytes_sent
        attrs["specdecode.wire.bytes_received"] = self.bytes_received
        for role, service in self.services.items():
            attrs.update({f"specdecode.{role}.{name}": value
                          for name, value in vars(service).items()})
        return attrs
