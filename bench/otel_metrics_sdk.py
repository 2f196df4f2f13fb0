"""Should /metrics and the OTLP push come from the OpenTelemetry metrics SDK (one MeterProvider
with a Prometheus reader and an OTLP reader) instead of prometheus_client plus the bridge in
specdecode/telemetry/otel_setup.py? This measures what the switch would change, on one latency
histogram recorded inside a sampled span (as the orchestrator's TTFT/ITL/E2E histograms are):

- exemplars: does the scrape (OpenMetrics, what Prometheus asks for) carry the trace id that
  the dashboard's latency panels link to?
- names: what /metrics calls the metric (the dashboard and vLLM 0.4.2's names depend on it);
- cost of one observation on the hot path (one per emitted token for ITL), ns, median of
  --repeats runs of --n observations;
- cost of one scrape with --series label sets.

    .venv/bin/pip install 'opentelemetry-exporter-prometheus==0.66b2'   # the bench extra
    python bench/otel_metrics_sdk.py

Prints a table; writes bench/results/otel_metrics_sdk.json. The decision and its numbers are
in docs/observability.md ("Over OTLP").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import prometheus_client
from opentelemetry import trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from rich.console import Console
from rich.table import Table

BUCKETS = (.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
LABELS = {"model_name": "m", "role": "orchestrator"}


def with_prometheus_client(registry):
    """The project's way: a prometheus_client histogram, the trace id as an exemplar."""
    h = prometheus_client.Histogram("specdecode_inter_token_latency_seconds", "ITL.",
                                    list(LABELS), buckets=BUCKETS, registry=registry)

    def observe(value: float, labels: dict) -> None:
        ctx = trace.get_current_span().get_span_context()
        h.labels(**labels).observe(value, {"trace_id": format(ctx.trace_id, "032x")})
    return observe


def with_otel_sdk(registry):
    """The SDK's way: one MeterProvider, a Prometheus reader (for /metrics) and a second
    reader standing in for the OTLP one (an in-memory reader: same aggregation path)."""
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
    prometheus_reader = PrometheusMetricReader()
    registry.register(prometheus_reader._collector)  # it registers itself in REGISTRY too
    provider = MeterProvider(
        metric_readers=[prometheus_reader, InMemoryMetricReader()],
        views=[View(instrument_name="*", aggregation=ExplicitBucketHistogramAggregation(
            list(BUCKETS)))])
    h = provider.get_meter("specdecode").create_histogram(
        "specdecode_inter_token_latency", unit="s", description="ITL.")

    def observe(value: float, labels: dict) -> None:
        h.record(value, labels)  # the SDK samples the exemplar from the current span
    return observe


def per_observation_ns(observe, n: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for i in range(n):
            observe(0.003 * (i % 7), LABELS)
        runs.append((time.perf_counter_ns() - start) / n)
    return statistics.median(runs)


def scrape_ms(registry, observe, series: int, repeats: int) -> float:
    for s in range(series):
        observe(0.01, {**LABELS, "model_name": f"m{s}"})
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        openmetrics_latest(registry)
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--series", type=int, default=50)
    args = parser.parse_args()
    trace.set_tracer_provider(TracerProvider())
    tracer = trace.get_tracer("bench")
    rows = {}
    for name, build in (("prometheus_client + bridge", with_prometheus_client),
                        ("OTel SDK, Prometheus + 2nd reader", with_otel_sdk)):
        registry = prometheus_client.CollectorRegistry()
        observe = build(registry)
        with tracer.start_as_current_span("request"):
            observe(0.02, LABELS)
            cost = per_observation_ns(observe, args.n, args.repeats)
        text = openmetrics_latest(registry).decode()
        lines = [line for line in text.splitlines() if "_bucket" in line and 'le="0.025"' in line]
        rows[name] = {
            "exemplar_on_scrape": "trace_id=" in text,
            "bucket_line": lines[0] if lines else "",
            "metric_names": sorted({line.split("{")[0].split(" ")[0]
                                    for line in text.splitlines()
                                    if line and not line.startswith("#")}),
            "ns_per_observation": cost,
            "scrape_ms": scrape_ms(registry, observe, args.series, args.repeats),
        }
    table = Table(title="one latency histogram: prometheus_client vs the OTel metrics SDK")
    for column in ("", "exemplar on /metrics", "ns / observation", f"scrape ms ({args.series} "
                   "series)"):
        table.add_column(column)
    for name, r in rows.items():
        table.add_row(name, str(r["exemplar_on_scrape"]), f"{r['ns_per_observation']:.0f}",
                      f"{r['scrape_ms']:.2f}")
    Console(width=120).print(table)
    for name, r in rows.items():
        print(f"{name}:\n  names: {', '.join(r['metric_names'])}\n  {r['bucket_line']}")
    out = Path(__file__).parent / "results" / "otel_metrics_sdk.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
