"""Strict validation of the custom resources the chart renders (HTTPRoute, GRPCRoute, Gateway,
BackendTLSPolicy, PrometheusRule, ServiceMonitor, ScaledObject, InferencePool), which
kubernetes-validate has no schemas for.

Each kind is checked against its project's own CRD schema (vendored in crds/, see crds/README.md)
made strict as kubernetes-validate --strict makes the core schemas: an object schema that lists
its properties accepts no others (unless it says x-kubernetes-preserve-unknown-fields). The
metadata is checked against Kubernetes' own ObjectMeta from kubernetes-validate's bundled
definitions. CEL rules (x-kubernetes-validations) are not evaluated.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jsonschema
from referencing import Registry, Resource

CRDS = Path(__file__).resolve().parent / "crds"
K8S_VERSION = "1.37.0"
OBJECT_META = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def strict(node):
    """The schema with additionalProperties: false on every object that lists its properties."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: strict(s) for name, s in value.items()}
        elif key in ("enum", "default", "example", "x-kubernetes-validations"):
            out[key] = value  # data, not schemas
        else:
            out[key] = strict(value)
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string"):
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


@cache
def _definitions() -> Resource:
    import importlib.resources
    path = importlib.resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{K8S_VERSION}-local-strict/_definitions.json")
    return Resource.from_contents(json.loads(path.read_text()))


@cache
def validators() -> dict[tuple[str, str], jsonschema.Validator]:
    """(apiVersion, kind) -> a validator for the whole object."""
    registry = _definitions() @ Registry()
    out = {}
    for path in sorted(CRDS.glob("*.json")):
        crd = json.loads(path.read_text())
        api_version = f"{crd['group']}/{crd['version']}"
        schema = strict(crd["openAPIV3Schema"])
        schema["properties"].update({
            "apiVersion": {"const": api_version}, "kind": {"const": crd["kind"]},
            "metadata": {"$ref": OBJECT_META}})
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        out[(api_version, crd["kind"])] = jsonschema.Draft202012Validator(schema, registry=registry)
    return out


def is_custom(doc: dict) -> bool:
    """Whether the document's API group is one of the vendored CRDs' (else kubernetes-validate's)."""
    return doc["apiVersion"].split("/")[0] in {api.split("/")[0] for api, _ in validators()}


def errors(doc: dict) -> list[str]:
    """What is wrong with one custom resource ([] when it is valid)."""
    validator = validators().get((doc["apiVersion"], doc["kind"]))
    if validator is None:
        return [f"no vendored schema for {doc['apiVersion']} {doc['kind']} in {CRDS}"]
    name = f"{doc['kind']}/{doc.get('metadata', {}).get('name')}"
    return [f"{name}: {'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in validator.iter_errors(doc)]
