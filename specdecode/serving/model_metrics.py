"""Prometheus metrics of a served model (proposer and scorer): forward-pass histograms, and
the runner's KV-cache counters read at scrape time."""

from __future__ import annotations

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdecode.executor.model_runner import ForwardStats, ModelRunner

FORWARD_SECONDS = prometheus_client.Histogram(
    "specdecode_model_forward_seconds", "Time of one model forward pass.", ["role"],
    buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
FORWARD_BATCH = prometheus_client.Histogram(
    "specdecode_model_forward_batch_size", "Rows (sequences) in one forward pass.", ["role"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
FORWARD_TOKENS = prometheus_client.Histogram(
    "specdecode_model_forward_tokens", "New tokens computed in one forward pass (what the KV "
    "cache did not save).", ["role"], buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384))


class RunnerCollector:
    """Reads a ModelRunner's counters at scrape time: KV cache hits, misses and occupancy,
    tokens computed. (Forward-pass counts and time are the histograms above.)"""

    def __init__(self, runner: ModelRunner, role: str):
        self.runner, self.role = runner, role

    def collect(self):
        stats, labels, pool = self.runner.stats, [self.role], self.runner.pool
        families = [
            (CounterMetricFamily, "specdecode_kv_cache_hits", "Rows that reused a cached KV "
             "prefix.", stats.cache_hits),
            (CounterMetricFamily, "specdecode_kv_cache_misses", "Rows computed from scratch "
             "(no cached prefix).", stats.cache_misses),
            (CounterMetricFamily, "specdecode_model_tokens_computed", "Tokens fed to the "
             "model.", stats.tokens_computed),
            (GaugeMetricFamily, "specdecode_kv_cache_sequences", "Sequences with a cached KV "
             "entry.", self.runner.num_cached_sequences),
            (GaugeMetricFamily, "specdecode_kv_cache_capacity_sequences", "Most sequences the "
             "KV cache keeps (least recently used are evicted).",
             self.runner.max_cached_sequences),
            (GaugeMetricFamily, "specdecode_kv_cache_tokens", "Tokens whose keys/values the "
             "KV cache pool holds.", pool.tokens_held),
            (GaugeMetricFamily, "specdecode_kv_cache_reserved_tokens", "Token slots reserved "
             "by cached sequences (held tokens plus growth room).", pool.tokens_reserved),
            (GaugeMetricFamily, "specdecode_kv_cache_capacity_tokens", "Token slots in the KV "
             "cache pool.", pool.capacity_tokens),
            (GaugeMetricFamily, "specdecode_kv_cache_occupancy", "Reserved / capacity token "
             "slots of the KV cache pool (0 to 1).", pool.tokens_reserved / pool.capacity_tokens),
            (GaugeMetricFamily, "specdecode_kv_cache_memory_bytes", "Size of the KV cache pool "
             "(allocated once).", pool.nbytes),
            (CounterMetricFamily, "specdecode_kv_cache_evictions", "Sequences dropped from the "
             "KV cache to make room (recomputed when they return).", pool.stats.evictions),
        ]
        compiled = self.runner.compiled
        if compiled is not None:
            families += [
                (GaugeMetricFamily, "specdecode_model_compile_seconds", "Compiling (or "
                 "reloading from the compile cache) the decode and verify forwards ready so "
                 "far.", compiled.stats.seconds),
                (GaugeMetricFamily, "specdecode_model_compiled_graphs", "Compiled forward "
                 "graphs (batch bucket x query length) ready; forwards of other shapes, and "
                 "all of them while this is 0, run eagerly.", compiled.stats.graphs),
                (CounterMetricFamily, "specdecode_model_compile_cache_hits", "Compiled graphs "
                 "reloaded from the on-disk compile cache (--compile-cache) instead of "
                 "compiled anew.", compiled.stats.cache_hits),
                (CounterMetricFamily, "specdecode_model_recompiles", "Forward graphs compiled "
                 "again after they were ready (a shape or guard compiling did not cover).",
                 compiled.stats.recompiles),
                (CounterMetricFamily, "specdecode_model_compiled_forwards", "Forwards that ran "
                 "a compiled graph.", compiled.stats.runs),
            ]
        for cls, name, doc, value in families:
            family = cls(name, doc, labels=["role"])
            family.add_metric(labels, value)
            yield family


_collectors: dict[str, RunnerCollector] = {}


def export_runner_metrics(runner: ModelRunner, role: str,
                          registry=prometheus_client.REGISTRY) -> None:
    """Export `runner`'s metrics under the label role=`role` (proposer | scorer); a later
    call for the same role replaces the earlier runner."""
    old = _collectors.pop(role, None)
    if old is not None:
        registry.unregister(old)
    collector = _collectors[role] = RunnerCollector(runner, role)
    registry.register(collector)
    seconds, batch, tokens = (FORWARD_SECONDS.labels(role), FORWARD_BATCH.labels(role),
                              FORWARD_TOKENS.labels(role))

    def observe(f: ForwardStats) -> None:
        seconds.observe(f.seconds)
        batch.observe(f.batch_size)
        tokens.observe(f.tokens_computed)
    runner.on_forward = observe
