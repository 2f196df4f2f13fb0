"""The chart with transport security, tokens and NetworkPolicies on (issue 11): it renders and
validates, every flag exists in the real CLI, only the orchestrator reaches the services, and the
TLS health probe the pods run works against a real mutual-TLS server."""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chartlib import NAMESPACE, ROOT, args_map, by_name, component_name, container, of_kind

sys.path.insert(0, str(ROOT))
from tests.support.certs import TestCA  # noqa: E402

COMPONENTS = ("proposer", "scorer", "orchestrator")
GUARD = ["tls.enabled=true", "tls.certManager.enabled=true", "tls.certManager.issuerRef.name=ca",
         "networkPolicy.enabled=true", "auth.tokenSecret=api-tokens",
         "orchestrator.service.type=LoadBalancer"]
TLS_FLAGS = {"proposer": {"--tls-cert", "--tls-key", "--tls-ca"},
             "scorer": {"--tls-cert", "--tls-key", "--tls-ca"},
             "orchestrator": {"--tls-cert", "--tls-key", "--service-tls-ca", "--auth-token-file"}}
K8S = ("1.37.0", "1.25.0")


@pytest.fixture(scope="module")
def docs(helm):
    return helm.render(sets=GUARD)


def server(docs, component):
    return container(by_name(docs, "Deployment", component_name(component)), component)


def test_guarded_chart_validates_strict(docs, tmp_path):
    core = [d for d in docs if not d["apiVersion"].startswith(("monitoring.coreos.com/",
                                                                 "cert-manager.io/"))]
    assert len(of_kind(core, "NetworkPolicy")) == 3
    path = tmp_path / "guard.yaml"
    path.write_text(yaml.safe_dump_all(core, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict",
                           *[a for k in K8S for a in ("-k", k)], str(path)],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "WARN" not in out and "ERROR" not in out, out
    assert out.count(" passed for resource ") == len(K8S) * len(core), out


def test_tls_and_token_flags_exist_in_the_real_cli_and_point_at_the_secrets(docs):
    from specdecode_stack.cli import serve
    for component in COMPONENTS:
        c = server(docs, component)
        flags = args_map(c)
        options = {o for p in serve.commands[component].params for o in p.opts}
        assert TLS_FLAGS[component] <= set(flags) and set(flags) <= options, component
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert flags["--tls-cert"] == mounts["tls"] + "/tls.crt"
        if component == "orchestrator":
            assert flags["--auth-token-file"] == mounts["auth-tokens"] + "/tokens"
        volumes = {v["name"]: v for v in by_name(docs, "Deployment", component_name(component))
                   ["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "sd-specdecode-tls"
    (cert,) = of_kind(docs, "Certificate")
    assert cert["spec"]["secretName"] == "sd-specdecode-tls"
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    for component in COMPONENTS:
        assert f"{component_name(component)}.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]


def test_only_the_orchestrator_reaches_the_services_and_only_the_scraper_metrics(docs):
    orchestrator = {"app.kubernetes.io/name": "specdecode", "app.kubernetes.io/instance": "sd",
                    "app.kubernetes.io/component": "orchestrator"}
    for component in COMPONENTS:
        policy = by_name(docs, "NetworkPolicy", component_name(component))
        assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        rules = {r["ports"][0]["port"]: r.get("from") for r in policy["spec"]["ingress"]}
        assert set(rules) == {"grpc", "metrics"}
        assert rules["metrics"] == [{"namespaceSelector": {}, "podSelector": {
            "matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
        if component == "orchestrator":
            assert rules["grpc"] is None  # the public API: apiFrom empty = every source
        else:
            selectors = [peer["podSelector"]["matchLabels"] for peer in rules["grpc"]]
            assert selectors[0] == orchestrator
            assert [s["app.kubernetes.io/component"] for s in selectors] == ["orchestrator", "test"]


def test_no_metrics_port_on_a_public_service(docs, helm):
    public = by_name(docs, "Service", component_name("orchestrator"))
    assert public["spec"]["type"] == "LoadBalancer"
    assert "metrics" not in [p["name"] for p in public["spec"]["ports"]]
    metrics = by_name(docs, "Service", component_name("orchestrator") + "-metrics")
    assert metrics["spec"]["type"] == "ClusterIP"
    for component in ("proposer", "scorer"):  # internal Services are headless, never exposed
        svc = by_name(docs, "Service", component_name(component))
        assert svc["spec"]["clusterIP"] == "None" and "type" not in svc["spec"]
    assert "issuerRef.name" in helm.template_fails(sets=GUARD[:2])
    # An empty metricsFrom admits no scraper at all (an empty `from` would admit everyone).
    policy = by_name(helm.render(sets=[*GUARD, "networkPolicy.metricsFrom=null"]), "NetworkPolicy",
                     component_name("scorer"))
    assert [r["ports"][0]["port"] for r in policy["spec"]["ingress"]] == ["grpc"]


def test_the_tls_probe_the_pods_run_checks_health_over_mutual_tls(docs, tmp_path):
    ca = TestCA(tmp_path)
    name = f"{component_name('scorer')}.{NAMESPACE}.svc"
    issued = ca.issue("scorer", dns_names=(name,))
    for src, dst in ((issued.cert, "tls.crt"), (issued.key, "tls.key"), (ca.ca_file, "ca.crt")):
        shutil.copy(src, tmp_path / dst)
    server_ = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server_)
    creds = grpc.ssl_server_credentials([(open(issued.key, "rb").read(), open(issued.cert, "rb").read())],
                                        root_certificates=open(ca.ca_file, "rb").read(),
                                        require_client_auth=True)
    port = server_.add_secure_port("127.0.0.1:0", creds)
    server_.start()
    try:
        c = server(docs, "scorer")
        command = c["readinessProbe"]["exec"]["command"]
        assert command[:3] == ["python", "-m", "specdecode.serving.probe"]
        assert "grpc" not in c["readinessProbe"]
        mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls")
        command = [a.replace(mount, str(tmp_path)).replace(":50053", f":{port}") for a in command]

        def probe():
            return subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                                  timeout=60, cwd=ROOT)
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe().returncode == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        out = probe()
        assert out.returncode == 1 and "NOT_SERVING" in out.stderr
    finally:
        server_.stop(None)
