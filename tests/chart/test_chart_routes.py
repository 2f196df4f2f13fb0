"""Traffic into the cluster: Gateway API routes (and the release's own Gateway), the Ingress
pair, BackendTLSPolicy and InferencePool; each renders, validates strictly, and points at the
orchestrator's real ports."""

from __future__ import annotations

import pytest

from chartlib import NAMESPACE, by_name, component_name, container, of_kind
from crdcheck import errors as crd_errors

ORCHESTRATOR = component_name("orchestrator")


def service_ports(docs) -> dict[str, dict]:
    return {p["name"]: p for p in by_name(docs, "Service", ORCHESTRATOR)["spec"]["ports"]}


def test_routes_reach_the_two_public_ports_through_https_listeners(rendered):
    docs = rendered["gateway"]
    ports = service_ports(docs)
    (gateway,) = of_kind(docs, "Gateway")
    listeners = {listener["name"]: listener for listener in gateway["spec"]["listeners"]}
    for kind, port, host in (("HTTPRoute", "http", "api.llm.example.com"), ("GRPCRoute", "grpc", "grpc.llm.example.com")):
        (route,) = of_kind(docs, kind)
        ((backend,),) = [rule["backendRefs"] for rule in route["spec"]["rules"]]
        assert backend == {"name": ORCHESTRATOR, "port": ports[port]["port"]}
        assert route["spec"]["hostnames"] == [host]
        (parent,) = route["spec"]["parentRefs"]
        listener = listeners[parent["sectionName"]]
        assert parent["name"] == gateway["metadata"]["name"] and listener["hostname"] == host
        assert listener["protocol"] == "HTTPS" and listener["tls"]["mode"] == "Terminate"
        assert listener["tls"]["certificateRefs"] == [{"kind": "Secret", "name": "llm-example-com-tls"}]
        assert listener["allowedRoutes"]["kinds"] == [{"kind": kind}]
    (http,) = of_kind(docs, "HTTPRoute")
    assert http["spec"]["rules"][0]["timeouts"] == {"request": "600s"}, "streamed completions outlive defaults"
    # Behind the Gateway the gRPC port speaks cleartext HTTP/2.
    assert ports["grpc"]["appProtocol"] == "kubernetes.io/h2c" and "appProtocol" not in ports["http"]


def test_routes_attach_to_an_existing_gateway(helm):
    docs = helm.render(sets=["orchestrator.gateway.enabled=true", "orchestrator.gateway.parentRefs[0].name=shared",
                             "orchestrator.gateway.parentRefs[0].namespace=gateways",
                             "orchestrator.gateway.grpc.enabled=false"])
    assert not of_kind(docs, "Gateway") and not of_kind(docs, "GRPCRoute")
    (route,) = of_kind(docs, "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"name": "shared", "namespace": "gateways"}]
    assert "hostnames" not in route["spec"] and not crd_errors(route)


def test_with_tls_the_gateway_verifies_the_orchestrator(helm):
    docs = helm.render(sets=["tls.enabled=true", "tls.certManager.enabled=true", "tls.certManager.issuerRef.name=ca",
                             "orchestrator.gateway.enabled=true", "orchestrator.gateway.parentRefs[0].name=gw",
                             "orchestrator.gateway.backendTLS.caConfigMap=specdecode-ca"])
    (policy,) = of_kind(docs, "BackendTLSPolicy")
    assert not crd_errors(policy)
    assert policy["spec"]["targetRefs"] == [{"group": "", "kind": "Service", "name": ORCHESTRATOR}]
    assert policy["spec"]["validation"]["caCertificateRefs"] == [{"group": "", "kind": "ConfigMap", "name": "specdecode-ca"}]
    (certificate,) = of_kind(docs, "Certificate")
    assert policy["spec"]["validation"]["hostname"] in certificate["spec"]["dnsNames"]
    assert "appProtocol" not in service_ports(docs)["grpc"], "TLS, not cleartext HTTP/2"


def test_inference_pool_selects_the_orchestrators_http_port(helm):
    docs = helm.render(sets=["orchestrator.inferencePool.enabled=true", "orchestrator.inferencePool.endpointPicker.name=epp",
                             "orchestrator.gateway.enabled=true", "orchestrator.gateway.parentRefs[0].name=gw"])
    (pool,) = of_kind(docs, "InferencePool")
    assert not crd_errors(pool)
    deployment = by_name(docs, "Deployment", ORCHESTRATOR)
    assert pool["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    http = next(p for p in container(deployment, "orchestrator")["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    (route,) = of_kind(docs, "HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": ORCHESTRATOR}]
    (grpc,) = of_kind(docs, "GRPCRoute")
    assert grpc["spec"]["rules"][0]["backendRefs"][0]["name"] == ORCHESTRATOR, "gRPC stays on the Service"


def test_ingress_pair_over_tls(rendered):
    docs = rendered["ingress"]
    ports = service_ports(docs)
    ingresses = {i["metadata"]["name"]: i for i in of_kind(docs, "Ingress")}
    assert sorted(ingresses) == [f"{ORCHESTRATOR}-grpc", f"{ORCHESTRATOR}-http"]
    for port, host in (("http", "api.llm.example.com"), ("grpc", "grpc.llm.example.com")):
        spec = ingresses[f"{ORCHESTRATOR}-{port}"]["spec"]
        assert spec["ingressClassName"] == "nginx"
        (rule,) = spec["rules"]
        assert rule["host"] == host
        (path,) = rule["http"]["paths"]
        assert path["backend"]["service"] == {"name": ORCHESTRATOR, "port": {"name": port}} and port in ports
        assert spec["tls"] == [{"hosts": [host], "secretName": f"{host.replace('.', '-')}-tls"}]
    grpc = ingresses[f"{ORCHESTRATOR}-grpc"]["metadata"]["annotations"]
    assert grpc["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    http = ingresses[f"{ORCHESTRATOR}-http"]["metadata"]["annotations"]
    assert "nginx.ingress.kubernetes.io/backend-protocol" not in http
    assert http["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"


def test_no_routes_by_default(rendered):
    for kind in ("Gateway", "HTTPRoute", "GRPCRoute", "Ingress", "InferencePool", "BackendTLSPolicy"):
        assert not of_kind(rendered["default"], kind), kind
    assert by_name(rendered["default"], "Service", ORCHESTRATOR)["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("sets,message", [
    (["orchestrator.gateway.enabled=true"], "attaches to no Gateway"),
    (["orchestrator.gateway.enabled=true", "orchestrator.gateway.create.enabled=true",
      "orchestrator.gateway.create.className=eg"], "needs className (your GatewayClass) and tlsSecretName"),
    (["orchestrator.gateway.enabled=true", "orchestrator.gateway.create.enabled=true",
      "orchestrator.gateway.create.className=eg", "orchestrator.gateway.create.tlsSecretName=s"],
     "orchestrator.gateway.http.hostnames: the chart's Gateway gives each host name an HTTPS listener"),
    (["orchestrator.gateway.enabled=true", "orchestrator.gateway.parentRefs[0].name=gw", "orchestrator.httpPort=0"],
     "orchestrator.gateway.http routes the HTTP API, which is off"),
    (["orchestrator.ingress.enabled=true", "orchestrator.httpPort=0"], "orchestrator.ingress.http routes the HTTP API"),
    (["orchestrator.ingress.enabled=true", "orchestrator.ingress.grpc.tlsSecretName=s"],
     "orchestrator.ingress.grpc.host: a TLS Ingress needs the host name"),
    (["orchestrator.inferencePool.enabled=true"], "orchestrator.inferencePool.endpointPicker.name"),
    (["tls.enabled=true", "tls.secretName=s", "orchestrator.gateway.enabled=true",
      "orchestrator.gateway.parentRefs[0].name=gw"], "orchestrator.gateway.backendTLS.caConfigMap"),
])
def test_incomplete_route_values_fail(helm, sets, message):
    assert message in helm.template_fails(sets=sets)
