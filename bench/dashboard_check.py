"""Every query of dashboards/specdecode.json, evaluated by a real Prometheus scraping a real
local stack, as Grafana would send it.

    python bench/dashboard_check.py                 # SmolLM2-135M target, n-gram proposer
    python bench/dashboard_check.py --pair tiny     # tiny random Llama pair: CI size, seconds

Starts the stack as a user does, `specdecode up --metrics-port P`, and finds each server's
address and metrics port (P, P+1, P+2) in the start lines it prints; then Prometheus
(scripts/install-prometheus.sh puts Debian's build in .cache/tools/bin) scraping those three
ports every second, with a `namespace` label as a Kubernetes scrape would add. Then two
phases, each query's $__rate_interval being the phase's length (it covers the phase and
nothing before it):

1. requests with speculation off (num_speculative_tokens 0): the acceptance panels' ratios
   are 0/0 (NaN), and each must map NaN to its "no speculation" text;
2. requests with speculation, and two the HTTP API refuses (400, 404): every target of every
   panel must return at least one series, every value finite (the HTTP errors' above 0),
   with the dashboard's variables as a user picks them (the target model and the draft
   model each from their own variable query).

Prints a table (panel, legend, series, values) and `up`'s console, and writes
bench/results/dashboard_check.json;
exits 1 when a panel shows no data or NaN.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
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

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "specdecode.json"
RESULTS = ROOT / "bench" / "results" / "dashboard_check.json"
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
        from specdecode_stack.local import free_port
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
    from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model
    model = build_tiny_model(TinyModelSpec(seed=1))
    for name in ("target", "draft"):
        model.save_pretrained(workdir / name)
    return (["--target-model", str(workdir / "target"), "--draft-model", str(workdir / "draft"),
             "--device", "cpu", "--speculation", "fixed", "--num-speculative-tokens", "3",
             "--draft-confidence", "0"],
            lambda text: [b % 256 for b in text.encode()][-32:])


def free_port_run(n: int) -> int:
    """The first of n consecutive ports free on 127.0.0.1 now."""
    import socket
    from specdecode_stack.local import free_port
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
        from specdecode_stack.local import free_port
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
    from specdecode.api.client import SpecDecodeClient
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


def print_table(title: str, checks: list[Check]) -> None:
    print(f"\n== {title}")
    print(f"{'':2} {'panel':44} {'legend':24} {'series':>6}  shown")
    for c in checks:
        print(f"{'ok' if c.ok else 'NO':2} {c.panel[:44]:44} {c.legend[:24]:24} {c.series:6d}  {c.shown}")


@click.command()
@click.option("--pair", type=click.Choice(["smollm2", "tiny"]), default="smollm2", show_default=True)
@click.option("--max-tokens", default=24, show_default=True)
def main(pair: str, max_tokens: int) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p.get("targets")]
    with tempfile.TemporaryDirectory() as tmp:
        args, encode = up_args(pair, Path(tmp))
        prompts = [encode(p) for p in PROMPTS]
        up = Up(args)
        prom = Prometheus(up.metrics_ports, Path(tmp))
        try:
            prom.wait_scraped()
            start = time.time()
            assert send(up.address, prompts[:1], max_tokens, 0) == 0
            # A counter's series starts at its first increment, which rate() cannot see:
            # refused requests now make the 4xx series the next phase's rate() counts.
            assert send_bad_http(up.http_port) == [400, 404]
            prom.wait_scraped()
            variables = resolve_variables(prom, dashboard)
            acceptance = [p for p in panels if nan_text(p)]
            idle = evaluate(prom, acceptance, variables, start, idle=True)
            start = time.time()
            drafted = send(up.address, prompts, max_tokens, None)
            assert send_bad_http(up.http_port) == [400, 404]
            prom.wait_scraped()
            busy = evaluate(prom, panels, variables, start, idle=False)
        finally:
            prom.stop()
            code = up.stop()
    print("\n== specdecode up's console (stdout, then stderr)")
    print("\n".join(up.stdout) + "\n" + up.stderr)
    print_table("speculation off (nothing drafted): acceptance panels", idle)
    print_table(f"speculating ({drafted} tokens drafted); variables {variables}", busy)
    failed = [c for c in idle + busy if not c.ok]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"pair": pair, "up": {"stdout": up.stdout, "stderr": up.stderr,
                                                        "metrics_ports": up.metrics_ports,
                                                        "first_metrics_port": up.first_metrics_port,
                                                        "exit_code": code},
                                   "variables": variables, "drafted": drafted,
                                   "idle": [asdict(c) for c in idle], "speculating": [asdict(c) for c in busy]},
                                  indent=1))
    print(f"\n{len(idle) + len(busy) - len(failed)}/{len(idle) + len(busy)} checks pass; wrote {RESULTS}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
