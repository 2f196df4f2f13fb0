"""Helpers and fixtures for the Helm chart checks: the real `helm` binary and rendered manifests.

helm comes from scripts/install-chart-tools.sh (.cache/tools/bin/helm) or PATH; without it
the tests fail (they are never skipped).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specdecode"
EXAMPLES = ROOT / "helm" / "values-examples"
INSTALL_HINT = "run scripts/install-chart-tools.sh (installs helm, kubernetes-validate and yamllint)"

# The value sets CI renders: name -> values files (empty: the chart's defaults).
VALUE_SETS = {
    "default": [],
    "cpu": [EXAMPLES / "cpu.yaml"],
    "nvidia": [EXAMPLES / "nvidia.yaml"],
    "npu-autoscale": [EXAMPLES / "npu-autoscale.yaml"],
    "gateway": [EXAMPLES / "gateway.yaml"],
    "ingress": [EXAMPLES / "ingress.yaml"],
    "cluster-fit": [EXAMPLES / "cluster-fit.yaml"],
}
RELEASE = "sd"
NAMESPACE = "llm"


def find_tool(name: str) -> str | None:
    """$NAME, .cache/tools/bin/<name> or <name> on PATH, whichever is an executable first."""
    candidates = [os.environ.get(name.upper()), str(ROOT / ".cache" / "tools" / "bin" / name), shutil.which(name)]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


@pytest.fixture(scope="session")
def promtool() -> str:
    binary = find_tool("promtool")
    if binary is None:
        pytest.fail("promtool not found in .cache/tools/bin or on PATH: run scripts/install-prometheus.sh")
    return binary


class Helm:
    """Runs the helm binary against the chart; caches renders."""

    def __init__(self, binary: str):
        self.binary = binary
        self._cache: dict[tuple, list[dict]] = {}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def template_args(self, files=(), sets=(), set_strings=()) -> list[str]:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        for f in files:
            args += ["-f", str(f)]
        for s in sets:
            args += ["--set", s]
        for s in set_strings:
            args += ["--set-string", s]
        return args

    def template_text(self, files=(), sets=(), set_strings=()) -> str:
        return self.run(*self.template_args(files, sets, set_strings)).stdout

    def template_fails(self, files=(), sets=(), set_strings=()) -> str:
        """Renders values that must be rejected; returns helm's error output."""
        proc = self.run(*self.template_args(files, sets, set_strings), check=False)
        assert proc.returncode != 0, f"helm accepted values it should reject: {sets} {set_strings}"
        return proc.stderr

    def render(self, files=(), sets=(), set_strings=()) -> list[dict]:
        key = (tuple(map(str, files)), tuple(sets), tuple(set_strings))
        if key not in self._cache:
            text = self.template_text(files, sets, set_strings)
            self._cache[key] = [d for d in yaml.safe_load_all(text) if d]
        return self._cache[key]


@pytest.fixture(scope="session")
def helm() -> Helm:
    binary = find_tool("helm")
    if binary is None:
        pytest.fail(f"helm not found in .cache/tools/bin or on PATH: {INSTALL_HINT}")
    version = subprocess.run([binary, "version", "--template", "{{.Version}}"], capture_output=True, text=True)
    if version.returncode != 0 or not version.stdout.startswith("v3."):
        pytest.fail(f"{binary} is not helm v3 ({version.stdout!r} {version.stderr!r}): {INSTALL_HINT}")
    return Helm(binary)


@pytest.fixture(scope="session")
def rendered(helm):
    """Name of a value set -> its rendered documents."""
    return {name: helm.render(files) for name, files in VALUE_SETS.items()}


@pytest.fixture(params=list(VALUE_SETS), scope="session")
def value_set(request):
    return request.param


# Helpers over rendered documents ---------------------------------------------------------------


def of_kind(docs, kind):
    return [d for d in docs if d.get("kind") == kind]


def by_name(docs, kind, name):
    for d in of_kind(docs, kind):
        if d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind} named {name}; have {[d['metadata']['name'] for d in of_kind(docs, kind)]}")


def component_name(component: str) -> str:
    return f"{RELEASE}-specdecode-{component}"


def pod_specs(docs):
    """(name, pod spec, pod labels) of every pod the documents create, Deployments and bare Pods."""
    out = []
    for d in docs:
        if d.get("kind") == "Deployment":
            t = d["spec"]["template"]
            out.append((d["metadata"]["name"], t["spec"], t["metadata"].get("labels", {})))
        elif d.get("kind") == "Pod":
            out.append((d["metadata"]["name"], d["spec"], d["metadata"].get("labels", {})))
    return out


def container(deployment: dict, name: str | None = None) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def args_map(c: dict) -> dict[str, str]:
    """--flag value pairs of a server container (after `serve <component>`)."""
    args = c["args"]
    assert args[0] == "serve", args
    pairs = args[2:]
    assert len(pairs) % 2 == 0, f"flags without values: {pairs}"
    out = {}
    for flag, value in zip(pairs[::2], pairs[1::2]):
        assert flag.startswith("--") and not value.startswith("--"), (flag, value)
        assert flag not in out, f"{flag} given twice"
        out[flag] = value
    return out


def env_map(c: dict) -> dict[str, dict]:
    out = {}
    for e in c.get("env", []):
        assert e["name"] not in out, f"env {e['name']} set twice in {c['name']}"
        out[e["name"]] = e
    return out
