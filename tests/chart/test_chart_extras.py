"""The helm test pod's script against real gRPC servers, NOTES.txt, and the Dockerfile beside the chart."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from concurrent import futures

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from chartlib import CHART, NAMESPACE, RELEASE, ROOT, VALUE_SETS, component_name, of_kind

PUBLIC_API = "specdecode.v1.SpecDecodeService"


def _test_pod(docs):
    (pod,) = of_kind(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    return pod


def _serve(status, services):
    """A gRPC server on loopback with grpc.health.v1 (overall status) and reflection listing `services`."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*services, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _run_test_pod(pod, addresses):
    (c,) = pod["spec"]["containers"]
    assert c["command"][0] == "python"
    env = {e["name"]: e["value"] for e in c["env"]}
    env.update({f"{name.upper()}_ADDRESS": address for name, address in addresses.items()})
    env["TIMEOUT_SECONDS"] = "5"
    env = {**os.environ, **env, "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([sys.executable, *c["command"][1:], *c["args"]], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("scorer_status,api,passes", [
    (health_pb2.HealthCheckResponse.SERVING, PUBLIC_API, True),
    (health_pb2.HealthCheckResponse.NOT_SERVING, PUBLIC_API, False),
    (health_pb2.HealthCheckResponse.SERVING, "specdecode.v1.Other", False),
], ids=["all-serving", "scorer-not-serving", "no-public-api"])
def test_helm_test_pod_checks_health_and_public_api(rendered, scorer_status, api, passes):
    pod = _test_pod(rendered["default"])
    servers, addresses = [], {}
    try:
        for name in ("proposer", "scorer", "orchestrator"):
            status = scorer_status if name == "scorer" else health_pb2.HealthCheckResponse.SERVING
            server, address = _serve(status, [api] if name == "orchestrator" else [])
            servers.append(server)
            addresses[name] = address
        proc = _run_test_pod(pod, addresses)
    finally:
        for server in servers:
            server.stop(None)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == passes, out
    assert ("PASS" if passes else "FAIL") in proc.stdout, out
    assert "Traceback" not in out, out


def test_helm_test_pod_fails_cleanly_when_a_server_is_down(rendered):
    pod = _test_pod(rendered["default"])
    server, address = _serve(health_pb2.HealthCheckResponse.SERVING, [PUBLIC_API])
    try:
        # Nothing listens on the proposer's and scorer's addresses.
        proc = _run_test_pod(pod, {"proposer": "127.0.0.1:1", "scorer": "127.0.0.1:1", "orchestrator": address})
    finally:
        server.stop(None)
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stdout, proc.stdout + proc.stderr


def test_helm_test_pod_targets_the_services(rendered):
    pod = _test_pod(rendered["default"])
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["ORCHESTRATOR_ADDRESS"] == f"{component_name('orchestrator')}.{NAMESPACE}.svc:50051"
    assert env["SCORER_ADDRESS"] == f"{component_name('scorer')}.{NAMESPACE}.svc:50053"
    assert env["PUBLIC_API"] == PUBLIC_API


def test_notes_render(helm, tmp_path):
    """NOTES.txt is not rendered by `helm template`; render it through tpl in a copy of the chart."""
    chart = tmp_path / "specdecode"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.copy")
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n'
        '  notes: {{ tpl (.Files.Get "notes.copy") . | toJson }}\n')
    for name, files in VALUE_SETS.items():
        args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, "--show-only", "templates/zz-notes.yaml"]
        for f in files:
            args += ["-f", str(f)]
        notes = yaml.safe_load(helm.run(*args).stdout)["data"]["notes"]
        assert f"{component_name('orchestrator')}.{NAMESPACE}.svc:50051" in notes, notes
        assert f"helm test {RELEASE}" in notes
        if name in ("nvidia", "npu-autoscale"):
            assert "http://otel-collector.observability:4317" in notes
        assert "<no value>" not in notes


def test_dockerfile_matches_the_chart():
    dockerfile = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", dockerfile, re.M))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(args["UID"]) == values["securityContext"]["runAsUser"]
    assert int(args["GID"]) == values["securityContext"]["runAsGroup"]
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert re.search(r'^ENTRYPOINT \["specdecode"\]$', dockerfile, re.M)
    assert re.search(r"^USER \$\{UID\}:\$\{GID\}$", dockerfile, re.M)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert f"torch=={args['TORCH_VERSION']}" in pyproject["project"]["dependencies"]
    assert "npu" in pyproject["project"]["optional-dependencies"]
    assert pyproject["project"]["scripts"]["specdecode"]
    # The build context keeps what `pip install .` needs.
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for needed in ("pyproject.toml", "README.md", "protos", "specdecode", "proposer_svc", "scorer_svc", "orchestrator"):
        assert needed not in ignored
