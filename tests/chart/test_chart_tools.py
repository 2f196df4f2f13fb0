"""The chart through the real tools: helm lint, helm template, kubernetes-validate, yamllint."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from chartlib import CHART, EXAMPLES, INSTALL_HINT, ROOT, VALUE_SETS, component_name, of_kind
from crdcheck import errors as crd_errors
from crdcheck import is_custom

# The newest Kubernetes the installed kubernetes-validate bundles, and the oldest the chart
# supports (Chart.yaml kubeVersion); both must accept every rendered manifest.
K8S_CURRENT = "1.37.0"
K8S_OLDEST = "1.25.0"
YAMLLINT_CONFIG = ROOT / "tests" / "chart" / "yamllint.yaml"


def python_tool(module: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300)
    if "No module named" in proc.stderr:
        pytest.fail(f"{module} is not installed in {sys.executable}: {INSTALL_HINT}")
    return proc


def test_kubernetes_validate_bundles_the_versions_checked():
    try:
        import kubernetes_validate.utils as kv
    except ImportError:
        pytest.fail(f"kubernetes-validate is not installed in {sys.executable}: {INSTALL_HINT}")

    assert kv.latest_version() == K8S_CURRENT, (
        f"kubernetes-validate now bundles {kv.latest_version()}: update K8S_CURRENT")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={K8S_OLDEST}-0"


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_strict(helm, name):
    args = ["lint", "--strict", str(CHART), "--namespace", "llm"]
    for f in VALUE_SETS[name]:
        args += ["-f", str(f)]
    proc = helm.run(*args)
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_manifests_pass_kubernetes_validate_strict(helm, tmp_path, name):
    docs = helm.render(VALUE_SETS[name])
    # cert-manager's Certificate (tls.certManager) is the one custom resource left unchecked.
    core = [d for d in docs if not is_custom(d) and not d["apiVersion"].startswith("cert-manager.io/")]
    assert len(core) >= 10
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(core, sort_keys=False))
    proc = python_tool("kubernetes_validate", "--strict", "-k", K8S_CURRENT, "-k", K8S_OLDEST, str(path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # Every document validated against both versions: no "couldn't find schema" warnings.
    assert "WARN" not in out and "ERROR" not in out, out
    assert out.count(" passed for resource ") == 2 * len(core), out


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_custom_resources_pass_their_crd_schemas_strict(helm, name):
    """Routes, Gateway, BackendTLSPolicy, PrometheusRule, ServiceMonitor, ScaledObject,
    InferencePool: each against its project's CRD schema (tests/chart/crds), strict."""
    custom = [d for d in helm.render(VALUE_SETS[name]) if is_custom(d)]
    assert not [e for d in custom for e in crd_errors(d)]


def test_crd_check_is_strict():
    route = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "r"},
             "spec": {"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": [{"name": "svc", "port": 80}]}]}}
    assert crd_errors(route) == []
    typo = {**route, "spec": {**route["spec"], "rules": [{"backendRef": [{"name": "svc", "port": 80}]}]}}
    assert "'backendRef' was unexpected" in " ".join(crd_errors(typo))
    bad_port = {**route, "spec": {**route["spec"], "rules": [{"backendRefs": [{"name": "svc", "port": 70000}]}]}}
    assert "70000 is greater than the maximum" in " ".join(crd_errors(bad_port))
    bad_meta = {**route, "metadata": {"name": "r", "label": {}}}
    assert "'label' was unexpected" in " ".join(crd_errors(bad_meta))
    unknown = {**route, "apiVersion": "gateway.networking.k8s.io/v2"}
    assert "no vendored schema" in crd_errors(unknown)[0]


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_manifests_pass_yamllint(helm, tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(helm.template_text(VALUE_SETS[name]))
    proc = python_tool("yamllint", "--strict", "-c", str(YAMLLINT_CONFIG), str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_values_files_pass_yamllint():
    files = [CHART / "values.yaml", CHART / "Chart.yaml", *sorted(EXAMPLES.glob("*.yaml"))]
    proc = python_tool("yamllint", "--strict", "-c", str(YAMLLINT_CONFIG), *map(str, files))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_examples_are_the_ones_ci_renders():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(
        f.name for files in VALUE_SETS.values() for f in files)


def test_servicemonitor_shape(rendered):
    docs = rendered["npu-autoscale"]
    (sm,) = of_kind(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm) == {"apiVersion", "kind", "metadata", "spec"}
    assert sm["metadata"]["namespace"] == "llm"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = sm["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "targetLabels", "jobLabel"}
    assert spec["namespaceSelector"] == {"matchNames": ["llm"]}
    (endpoint,) = spec["endpoints"]
    assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout", "relabelings"}
    assert endpoint["path"] == "/metrics" and endpoint["scheme"] == "http"

    def seconds(d):
        return int(d[:-1]) * {"s": 1, "m": 60, "h": 3600}[d[-1]]

    assert seconds(endpoint["scrapeTimeout"]) <= seconds(endpoint["interval"])
    # The selector picks exactly the three component Services, and each has the named port.
    selector = spec["selector"]
    (expr,) = selector["matchExpressions"]
    assert expr["operator"] == "In" and expr["key"] == "app.kubernetes.io/component"
    selected = []
    for svc in of_kind(docs, "Service"):
        labels = svc["metadata"]["labels"]
        if all(labels.get(k) == v for k, v in selector["matchLabels"].items()) and labels.get(expr["key"]) in expr["values"]:
            selected.append(svc["metadata"]["name"])
            assert endpoint["port"] in [p["name"] for p in svc["spec"]["ports"]]
    assert sorted(selected) == sorted(component_name(c) for c in ("proposer", "scorer", "orchestrator"))
    for label in spec["targetLabels"]:
        assert label in of_kind(docs, "Service")[0]["metadata"]["labels"]


def test_no_servicemonitor_unless_enabled(rendered):
    for name in ("default", "cpu", "nvidia"):
        assert not of_kind(rendered[name], "ServiceMonitor")
