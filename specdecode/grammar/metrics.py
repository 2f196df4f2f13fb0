"""Prometheus counters of a Grammars (proposer, scorer, orchestrator), read at scrape time."""

from __future__ import annotations

import prometheus_client
from prometheus_client.core import CounterMetricFamily

from specdecode.grammar.matcher import Grammars


class GrammarCollector:
    def __init__(self, grammars: Grammars, role: str):
        self.grammars, self.role = grammars, role

    def collect(self):
        stats = self.grammars.stats
        for name, doc, value in (
                ("specdecode_grammar_masks", "Allowed-token masks computed (one per "
                 "constrained position scored or drafted).", stats.masks),
                ("specdecode_grammar_mask_seconds", "Time spent computing grammar masks, "
                 "syncing the matchers included.", stats.seconds),
                ("specdecode_grammar_forced_tokens", "Tokens the grammar forced (the only one "
                 "it allowed), emitted without a forward (jump-forward).", stats.forced),
                ("specdecode_grammar_compiles", "Grammars compiled (cache misses).",
                 self.grammars.compiler.compiles)):
            family = CounterMetricFamily(name, doc, labels=["role"])
            family.add_metric([self.role], value)
            yield family


_collectors: dict[str, GrammarCollector] = {}


def export_grammar_metrics(grammars: Grammars | None, role: str,
                           registry=prometheus_client.REGISTRY) -> None:
    """Export `grammars`' counters under role=`role`; a later call for the role replaces it."""
    old = _collectors.pop(role, None)
    if old is not None:
        registry.unregister(old)
    if grammars is not None:
        collector = _collectors[role] = GrammarCollector(grammars, role)
        registry.register(collector)
