"""Telemetry: what tracing costs a step, what switching /metrics to the OpenTelemetry SDK
would change, and whether every dashboard query has data in a real Prometheus.

    python bench/telemetry_bench.py tracing [--model tiny|smollm2] [--blocks 10]
    python bench/telemetry_bench.py otel-sdk [--n 20000]     # needs the bench extra
    python bench/telemetry_bench.py dashboard [--pair smollm2|tiny]

Each subcommand prints one table and writes JSON under bench/results/; `--model tiny` and
`--pair tiny` run in seconds to a minute (tests/integration runs `dashboard --pair tiny`).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the root: bench.harness
from bench.harness import ROOT, RESULTS, metric_total, save, save_models, show  # noqa: E402
from specdecode.api.client import SpecDecodeClient, build_request  # noqa: E402
from specdecode.models.checkpoints import load_tokenizer  # noqa: E402
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model  # noqa: E402
from specdecode_stack.local import LocalStack, StackConfig, free_port  # noqa: E402


@click.group()
def cli() -> None:
    """Telemetry, one question per subcommand."""


# -- tracing -----------------------------------------------------------------------------------

RECEIVER = """
import sys
from concurrent import futures
import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as m, metrics_service_pb2_grpc as mg
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as t, trace_service_pb2_grpc as tg
class Traces(tg.TraceServiceServicer):
    def Export(self, request, context): return t.ExportTraceServiceResponse()
class Metrics(mg.MetricsServiceServicer):
    def Export(self, request, context): return m.ExportMetricsServiceResponse()
server = grpc.server(futures.ThreadPoolExecutor(2))
tg.add_TraceServiceServicer_to_server(Traces(), server)
mg.add_MetricsServiceServicer_to_server(Metrics(), server)
server.add_insecure_port("127.0.0.1:" + sys.argv[1]); server.start(); server.wait_for_termination()
"""
TRACED_PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return",
                  "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
                  "The capital of France is", "import numpy as np\nimport"]


def traced_stack(model: str, receiver_port: int) -> tuple[StackConfig, list]:
    """The stack (tiny: a random 4-layer Llama drafting for itself; smollm2: n-gram drafts),
    exporting OTLP/gRPC to the receiver, and its prompts."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver_port}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    if model == "smollm2":
        tok = load_tokenizer(None)
        return (StackConfig(draft_model="ngram", device="cpu", port=0, extra_env=env),
                [tok(p).input_ids for p in TRACED_PROMPTS])
    tiny = save_models(tempfile.mkdtemp(), tiny=build_tiny_model(
        TinyModelSpec(seed=1, hidden_size=256, num_layers=4)))["tiny"]
    gen = torch.Generator().manual_seed(0)
    return (StackConfig(target_model=tiny, draft_model=tiny, tokenizer="none", device="cpu",
                        port=0, extra_env=env),
            [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (8, 16, 24, 32)])


def block_ms(stack: LocalStack, prompts, max_tokens: int, sampled: bool) -> float:
    """4 concurrent requests with a sampled (or unsampled) W3C traceparent: ms per step."""
    def one(i: int) -> None:
        traceparent = (f"00-{random.getrandbits(128):032x}-{random.getrandbits(64):016x}-"
                       f"{'01' if sampled else '00'}")
        with SpecDecodeClient(stack.address) as client:
            request = build_request(prompts[i % len(prompts)], max_tokens=max_tokens)
            for _ in client.stub.Generate(request, metadata=[("traceparent", traceparent)]):
                pass
    port = stack.metrics_ports["orchestrator"]
    step = lambda part: metric_total(port, f"specdecode_step_duration_seconds_{part}")  # noqa: E731
    s0, n0 = step("sum"), step("count")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(4)))
    return 1000 * (step("sum") - s0) / (step("count") - n0)


@cli.command()
@click.option("--model", type=click.Choice(["tiny", "smollm2"]), default="tiny", show_default=True)
@click.option("--blocks", default=10, show_default=True, help="Block pairs (traced + untraced).")
@click.option("--max-tokens", default=48, show_default=True)
@click.option("--out", default=str(RESULTS / "tracing_cost.json"), show_default=True)
def tracing(model: str, blocks: int, max_tokens: int, out: str) -> None:
    """Step time with spans exported against not, inside one running stack: tracing on
    (OTLP/gRPC to a receiver in another process, as a collector would be), blocks of 4
    concurrent requests alternating between a sampled and an unsampled traceparent (an
    unsampled request makes no span anywhere); step time from the orchestrator's /metrics.
    Reports the paired per-block difference (median) as a share of the untraced step time;
    target: under 3%."""
    port = free_port()
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])
    per_step = {True: [], False: []}
    try:
        config, prompts = traced_stack(model, port)
        with LocalStack(config) as stack:
            block_ms(stack, prompts[:1], max_tokens, True), block_ms(stack, prompts[:1], max_tokens, False)
            for b in range(blocks):
                for sampled in ((True, False) if b % 2 else (False, True)):
                    per_step[sampled].append(block_ms(stack, prompts, max_tokens, sampled))
    finally:
        receiver.kill()
        receiver.wait()
    untraced = statistics.median(per_step[False])
    diffs = [t - u for t, u in zip(per_step[True], per_step[False])]
    result = {"model": model, "blocks": blocks, "untraced_step_ms": untraced,
              "traced_step_ms": statistics.median(per_step[True]),
              "paired_diff_ms": statistics.median(diffs),
              "paired_diff_pct": 100 * statistics.median(diffs) / untraced}
    show(f"tracing cost, {model}, {blocks} block pairs of 4 requests",
         ("untraced step ms", "traced step ms", "paired difference", "share"),
         [(f"{untraced:.2f}", f"{result['traced_step_ms']:.2f}", f"{result['paired_diff_ms']:+.2f} ms",
           f"{result['paired_diff_pct']:+.1f}%")], width=120)
    save(out, **result)


# -- otel-sdk ----------------------------------------------------------------------------------

BUCKETS = (.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
LABELS = {"model_name": "m", "role": "orchestrator"}


def with_prometheus_client(registry):
    """The project's way: a prometheus_client histogram, the trace id as an exemplar."""
    import prometheus_client  # noqa: PLC0415
    from opentelemetry import trace  # noqa: PLC0415
    h = prometheus_client.Histogram("specdecode_inter_token_latency_seconds", "ITL.",
                                    list(LABELS), buckets=BUCKETS, registry=registry)

    def observe(value: float, labels: dict) -> None:
        ctx = trace.get_current_span().get_span_context()
        h.labels(**labels).observe(value, {"trace_id": format(ctx.trace_id, "032x")})
    return observe


def with_otel_sdk(registry):
    """The SDK's way: one MeterProvider, a Prometheus reader (for /metrics) and a second
    reader standing in for the OTLP one (an in-memory reader: same aggregation path)."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader  # noqa: PLC0415
    from opentelemetry.sdk.metrics import MeterProvider  # noqa: PLC0415
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: PLC0415
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View  # noqa: PLC0415
    prometheus_reader = PrometheusMetricReader()
    registry.register(prometheus_reader._collector)  # it registers itself in REGISTRY too
    provider = MeterProvider(
        metric_readers=[prometheus_reader, InMemoryMetricReader()],
        views=[View(instrument_name="*", aggregation=ExplicitBucketHistogramAggregation(list(BUCKETS)))])
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


def one_way(build, tracer, n: int, repeats: int, series: int) -> dict:
    """Exemplars on the OpenMetrics scrape, the names /metrics uses, ns per observation (in
    a sampled span), ms per scrape of `series` label sets."""
    import prometheus_client  # noqa: PLC0415
    from prometheus_client.openmetrics.exposition import generate_latest  # noqa: PLC0415
    registry = prometheus_client.CollectorRegistry()
    observe = build(registry)
    with tracer.start_as_current_span("request"):
        observe(0.02, LABELS)
        cost = per_observation_ns(observe, n, repeats)
    text = generate_latest(registry).decode()
    lines = [line for line in text.splitlines() if "_bucket" in line and 'le="0.025"' in line]
    for s in range(series):
        observe(0.01, {**LABELS, "model_name": f"m{s}"})
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    return {"exemplar_on_scrape": "trace_id=" in text, "bucket_line": lines[0] if lines else "",
            "metric_names": sorted(names), "ns_per_observation": cost,
            "scrape_ms": 1000 * statistics.median(
                [timed(lambda: generate_latest(registry)) for _ in range(repeats)])}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@cli.command("otel-sdk")
@click.option("--n", default=20000, show_default=True, help="Observations per timed run.")
@click.option("--repeats", default=7, show_default=True)
@click.option("--series", default=50, show_default=True)
@click.option("--out", default=str(RESULTS / "otel_metrics_sdk.json"), show_default=True)
def otel_sdk(n: int, repeats: int, series: int, out: str) -> None:
    """Should /metrics and the OTLP push come from the OpenTelemetry metrics SDK (one
    MeterProvider, a Prometheus reader and an OTLP reader) instead of prometheus_client plus
    the bridge in specdecode/telemetry/otel_setup.py? On one latency histogram recorded inside a
    sampled span: whether the scrape (OpenMetrics) carries the trace id the dashboard's
    latency panels link to, the metric's names on /metrics, ns per observation (median of
    --repeats runs of --n), ms per scrape with --series label sets. Needs the bench extra
    (opentelemetry-exporter-prometheus); the decision is in docs/observability.md."""
    from opentelemetry import trace  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    trace.set_tracer_provider(TracerProvider())
    tracer = trace.get_tracer("bench")
    rows = {name: one_way(build, tracer, n, repeats, series)
            for name, build in (("prometheus_client + bridge", with_prometheus_client),
                                ("OTel SDK, Prometheus + 2nd reader", with_otel_sdk))}
    show("one latency histogram: prometheus_client vs the OTel metrics SDK",
         ("", "exemplar on /metrics", "ns / observation", f"scrape ms ({series} series)", "names"),
         [(name, r["exemplar_on_scrape"], f"{r['ns_per_observation']:.0f}", f"{r['scrape_ms']:.2f}",
           ", ".join(r["metric_names"])) for name, r in rows.items()], width=160)
    save(out, n=n, repeats=repeats, series=series, rows=rows)


# -- dashboard ---------------------------------------------------------------------------------

DASHBOARD = ROOT / "dashboards" / "specdecode.json"
NAMESPACE = "local"
HTTP_ERRORS_PANEL = "HTTP 4xx / 5xx responses"  # must show the refused requests sent
PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + ",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
           "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the"]


@dataclass
class Check:
    panel: str
    legend: str
    expr: str
    series: int
    values: list[float]
    shown: str  # what the panel shows: the values, a mapped text, or "No data"
    ok: bool


def prometheus_binary() -> str:
    for candidate in (os.environ.get("PROMETHEUS"), str(ROOT / ".cache" / "tools" / "bin" / "prometheus"),
                      shutil.which("prometheus")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise click.ClickException("prometheus not found: run scripts/install-prometheus.sh")


class Prometheus:
    """A Prometheus server on 127.0.0.1 scraping `targets` (job -> port) every second."""

    def __init__(self, targets: dict[str, int], workdir: Path):
        self.port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": job, "static_configs": [
                      {"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": NAMESPACE}}]}
                      for job, port in targets.items()]}
        (workdir / "prometheus.yml").write_text(json.dumps(config))
        self.log = open(workdir / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [prometheus_binary(), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.jobs = list(targets)

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return json.load(r)["data"]
        except urllib.error.HTTPError as e:  # a bad query: Prometheus says why
            raise click.ClickException(f"{params}: {e.read().decode()}") from None

    def query(self, expr: str) -> list[tuple[dict, float]]:
        return [(s["metric"], float(s["value"][1])) for s in self.api("query", query=expr)["result"]]

    def label_values(self, label: str, match: str) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": match})

    def wait_scraped(self, timeout_s: float = 60.0) -> None:
        """Until every job has been scraped, up, twice after this call."""
        start = time.time()
        while time.time() - start < timeout_s:
            try:
                fresh = self.query(f"timestamp(up == 1) > {start + 1.5}")
            except OSError:
                fresh = []
            if len(fresh) == len(self.jobs):
                return
            time.sleep(0.5)
        raise click.ClickException(f"Prometheus did not scrape {self.jobs} (log: {self.log.name})")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        self.log.close()


def substitute(expr: str, variables: dict[str, str], window: str = "1m") -> str:
    """The query as Grafana sends it: $__rate_interval (here the phase's length) and each
    $variable replaced."""
    expr = expr.replace("$__rate_interval", window)
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${name}", variables[name])
    return expr


def nan_text(panel: dict) -> str | None:
    for mapping in panel.get("fieldConfig", {}).get("defaults", {}).get("mappings", []):
        if mapping["type"] == "special" and mapping["options"]["match"] in ("nan", "null+nan"):
            return mapping["options"]["result"]["text"]
    return None


def evaluate(prom: Prometheus, panels: list[dict], variables: dict[str, str], since: float,
             idle: bool) -> list[Check]:
    """One check per target, over the window from `since` (a phase's start) to now. idle
    (nothing drafted): NaN passes where the panel maps it to a text; otherwise a target
    passes with >= 1 series, all finite."""
    window = f"{math.ceil(time.time() - since) + 2}s"
    checks = []
    for panel in panels:
        for target in panel.get("targets", []):
            result = prom.query(substitute(target["expr"], variables, window))
            values = [v for _, v in result]
            finite = bool(values) and all(math.isfinite(v) for v in values)
            mapped = nan_text(panel) if values and all(math.isnan(v) for v in values) else None
            shown = mapped or (", ".join(f"{v:.4g}" for v in values[:4]) if values else "No data")
            ok = mapped is not None if idle else finite
            if panel["title"] == HTTP_ERRORS_PANEL and not idle:  # refused requests were sent
                ok = finite and sum(values) > 0
            checks.append(Check(panel["title"], target.get("legendFormat", ""), target["expr"],
                                len(result), values, shown, ok))
    return checks


def resolve_variables(prom: Prometheus, dashboard: dict) -> dict[str, str]:
    """Each variable as a user would pick it: query ones to the single value their query
    returns (the target model, the draft model), the others to their "All" value."""
    variables = {}
    for v in dashboard["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.*), (\w+)\)", v["definition"])
        values = prom.label_values(m[2], substitute(m[1], variables)) if m else []
        if v["name"] in ("model", "draft"):
            if len(values) != 1:
                series = prom.api("series", **{"match[]": substitute(m[1], variables)})
                raise click.ClickException(f"variable {v['name']}: expected one value, got {values} "
                                           f"from {sorted({(s['job'], s['method'], s['model_name']) for s in series})}")
            # As Grafana interpolates a regex variable: metacharacters escaped, and the
            # backslashes doubled inside PromQL's double-quoted string.
            variables[v["name"]] = re.escape(values[0]).replace("\\", "\\\\")
        else:
            variables[v["name"]] = v.get("allValue", ".*")
    return variables


def up_args(pair: str, workdir: Path) -> tuple[list[str], object]:
    """`specdecode up`'s model options for the pair, and the prompt encoder: tiny (a random
    Llama as both target and draft, saved twice so the two model names differ and every
    draft token is accepted; token ids, no tokenizer) or SmolLM2 with n-gram drafts."""
    if pair == "smollm2":
        return [], lambda text: text
    model = build_tiny_model(TinyModelSpec(seed=1))
    dirs = save_models(workdir, target=model, draft=model)
    return (["--target-model", dirs["target"], "--draft-model", dirs["draft"],
             "--device", "cpu", "--speculation", "fixed", "--num-speculative-tokens", "3",
             "--draft-confidence", "0"],
            lambda text: [b % 256 for b in text.encode()][-32:])


def free_port_run(n: int) -> int:
    """The first of n consecutive ports free on 127.0.0.1 now."""
    while True:
        first = free_port()
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


START_LINE = re.compile(r"^(scorer|proposer|orchestrator)\s+(\S+)\s+metrics "
                        r"http://[^/]+:(\d+)/metrics\s+(.*)$")


class Up:
    """`specdecode up --metrics-port P` as a user runs it, its servers found from the start
    lines it prints: `address` (the orchestrator's), `metrics_ports` (role -> port),
    `http_port`; `stdout` and (after stop) `stderr` are its console."""

    def __init__(self, args: list[str]):
        self.first_metrics_port = free_port_run(3)
        self.http_port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specdecode_stack.cli", "up", "--port", "0",
             "--http-port", str(self.http_port), "--metrics-port", str(self.first_metrics_port),
             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stdout: list[str] = []
        self.stderr = ""
        self.metrics_ports: dict[str, int] = {}
        for line in self.process.stdout:  # until it serves, or exits
            self.stdout.append(line.rstrip("\n"))
            m = START_LINE.match(line)
            if m:
                self.metrics_ports[m[1]] = int(m[3])
                if m[1] == "orchestrator":
                    self.address = m[2]
            if line.startswith("specdecode is serving"):
                return
        self.stop()
        raise click.ClickException(f"specdecode up did not start: {self.stderr[-3000:]}")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)  # Ctrl-C
        out, self.stderr = self.process.communicate(timeout=120)
        self.stdout += out.splitlines()
        return self.process.returncode


def send(address: str, prompts: list, max_tokens: int, k: int | None) -> int:
    """Generates for each prompt; the draft tokens the requests report in all."""
    drafted = 0
    with SpecDecodeClient(address, timeout_s=600) as client:
        for p in prompts:
            drafted += client.generate(p, max_tokens=max_tokens, num_speculative_tokens=k).usage.draft_tokens
    return drafted


def send_bad_http(http_port: int) -> list[int]:
    """Requests the HTTP API refuses (a bad field, an unknown model): the statuses, for the
    4xx panel."""
    statuses = []
    for path, body in (("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}),
                       ("/v1/completions", {"model": "no-such-model", "prompt": [1, 2]})):
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}{path}", method="POST",
                                         data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=60)
            statuses.append(200)
        except urllib.error.HTTPError as e:
            statuses.append(e.code)
    return statuses


def phases(up: Up, prom: Prometheus, dashboard: dict, prompts, max_tokens: int) -> tuple:
    """Speculation off (the acceptance panels must map NaN to their text), then on with two
    refused HTTP requests (every target must have finite data): (idle, busy, variables,
    drafted)."""
    panels = [p for p in dashboard["panels"] if p.get("targets")]
    prom.wait_scraped()
    start = time.time()
    assert send(up.address, prompts[:1], max_tokens, 0) == 0
    # A counter's series starts at its first increment, which rate() cannot see: refused
    # requests now make the 4xx series the next phase's rate() counts.
    assert send_bad_http(up.http_port) == [400, 404]
    prom.wait_scraped()
    variables = resolve_variables(prom, dashboard)
    idle = evaluate(prom, [p for p in panels if nan_text(p)], variables, start, idle=True)
    start = time.time()
    drafted = send(up.address, prompts, max_tokens, None)
    assert send_bad_http(up.http_port) == [400, 404]
    prom.wait_scraped()
    return idle, evaluate(prom, panels, variables, start, idle=False), variables, drafted


@cli.command()
@click.option("--pair", type=click.Choice(["smollm2", "tiny"]), default="smollm2", show_default=True,
              help="smollm2: SmolLM2-135M target, n-gram proposer; tiny: a tiny random Llama pair.")
@click.option("--max-tokens", default=24, show_default=True)
@click.option("--out", default=str(ROOT / "bench" / "results" / "dashboard_check.json"), show_default=True)
def dashboard(pair: str, max_tokens: int, out: str) -> None:
    """Every query of dashboards/specdecode.json, evaluated by a real Prometheus scraping a
    real local stack, as Grafana would send it. The stack starts as a user starts it,
    `specdecode up --metrics-port P` (each server's address and metrics port read from the
    start lines it prints); Prometheus (scripts/install-prometheus.sh) scrapes the three
    ports every second with a `namespace` label. Two phases, each query's $__rate_interval
    its length: (1) speculation off: the acceptance panels' 0/0 (NaN) must map to their "no
    speculation" text; (2) speculation on and two requests the HTTP API refuses (400, 404):
    every target must return at least one series, every value finite (the HTTP errors' above
    0), with the dashboard's variables as a user picks them. Prints `up`'s console and one
    table of the checks; exits 1 when a panel shows no data or NaN."""
    dashboard_json = json.loads(DASHBOARD.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        args, encode = up_args(pair, Path(tmp))
        up = Up(args)
        prom = Prometheus(up.metrics_ports, Path(tmp))
        try:
            idle, busy, variables, drafted = phases(up, prom, dashboard_json,
                                                    [encode(p) for p in PROMPTS], max_tokens)
        finally:
            prom.stop()
            code = up.stop()
    print("== specdecode up's console (stdout, then stderr)\n" + "\n".join(up.stdout) + "\n" + up.stderr)
    failed = [c for c in idle + busy if not c.ok]
    show(f"dashboard queries in Prometheus: {len(idle) + len(busy) - len(failed)}/{len(idle) + len(busy)} "
         f"pass ({drafted} tokens drafted; variables {variables})",
         ("phase", "", "panel", "legend", "series", "shown"),
         [(phase, "ok" if c.ok else "NO", c.panel, c.legend, c.series, c.shown)
          for phase, checks in (("speculation off", idle), ("speculating", busy)) for c in checks])
    save(out, pair=pair, up={"stdout": up.stdout, "stderr": up.stderr, "metrics_ports": up.metrics_ports,
                             "first_metrics_port": up.first_metrics_port, "exit_code": code},
         variables=variables, drafted=drafted, idle=[asdict(c) for c in idle],
         speculating=[asdict(c) for c in busy])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    cli()
