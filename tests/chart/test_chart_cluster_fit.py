"""What shared clusters ask of the chart: mirrored images pinned by digest, labels on everything,
environment from Secrets, extra volumes, sidecars and init containers, /dev/shm, and scaling
that says what it needs (KEDA, an HPA External metric, prometheus-adapter)."""

from __future__ import annotations

import pytest

from chartlib import NAMESPACE, by_name, component_name, container, of_kind, pod_specs

COMPONENTS = ("proposer", "scorer", "orchestrator")
DIGEST = "sha256:4b7e1f0c9a3d5e2f6b8a0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f"
LABELS = {"team": "llm-serving", "cost-center": "4711"}


def deployment(docs, component):
    return by_name(docs, "Deployment", component_name(component))


def pod_spec(docs, component):
    return deployment(docs, component)["spec"]["template"]["spec"]


def test_images_from_the_mirror_by_digest(rendered):
    for name, spec, _ in pod_specs(rendered["cluster-fit"]):
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["image"].startswith("mirror.example.com/ml/"), (name, c["image"])
            if c["name"] in (*COMPONENTS, "prepare-models", "grpc-health"):
                assert c["image"] == f"mirror.example.com/ml/specdecode@{DIGEST}"


@pytest.mark.parametrize("override,image", [
    ([], f"specdecode@{DIGEST}"),
    (["scorer.image.tag=0.2.0"], "specdecode:0.2.0"),  # a tag of its own drops the inherited digest
    ([f"scorer.image.digest={DIGEST.replace('4b', '00')}"], f"specdecode@{DIGEST.replace('4b', '00')}"),
    (["scorer.image.repository=other"], "other:0.1.0"),
])
def test_a_components_image_override_and_the_digest(helm, override, image):
    docs = helm.render(sets=[f"image.digest={DIGEST}", *override])
    assert container(deployment(docs, "scorer"), "scorer")["image"] == image


def test_a_bad_digest_is_refused(helm):
    assert "image.digest: Does not match pattern" in helm.template_fails(sets=["image.digest=latest"])


def test_common_labels_on_every_resource_and_pod_never_on_selectors(rendered):
    docs = rendered["cluster-fit"]
    for d in docs:
        assert LABELS.items() <= d["metadata"]["labels"].items(), (d["kind"], d["metadata"]["name"])
    for name, _, labels in pod_specs(docs):
        assert LABELS.items() <= labels.items(), name
    for d in of_kind(docs, "Deployment"):
        assert not set(LABELS) & set(d["spec"]["selector"]["matchLabels"])
    for d in of_kind(docs, "Service"):
        assert not set(LABELS) & set(d["spec"]["selector"])


def test_scorer_gets_shm_and_secret_environment(rendered):
    docs = rendered["cluster-fit"]
    spec = pod_spec(docs, "scorer")
    c = container(deployment(docs, "scorer"), "scorer")
    volumes = {v["name"]: v for v in spec["volumes"]}
    (shm,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert c["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    for component in ("proposer", "orchestrator"):  # off unless asked for
        other = container(deployment(docs, component), component)
        assert "envFrom" not in other and "/dev/shm" not in [m["mountPath"] for m in other["volumeMounts"]]


def test_orchestrator_sidecar_init_container_and_extra_volume(rendered):
    docs = rendered["cluster-fit"]
    spec = pod_spec(docs, "orchestrator")
    assert [c["name"] for c in spec["containers"]] == ["orchestrator", "log-shipper"]
    assert [c["name"] for c in spec["initContainers"]] == ["prepare-models", "wait-for-scorer"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["chat-templates"] == {"name": "chat-templates", "configMap": {"name": "chat-templates"}}
    mounts = {m["name"]: m for m in container(deployment(docs, "orchestrator"), "orchestrator")["volumeMounts"]}
    assert mounts["chat-templates"] == {"name": "chat-templates", "mountPath": "/etc/specdecode/templates",
                                        "readOnly": True}
    for c in spec["containers"] + spec["initContainers"]:  # every mount has its volume
        assert {m["name"] for m in c.get("volumeMounts", [])} <= set(volumes), c["name"]


def test_extra_init_containers_without_the_model_init_container(helm):
    docs = helm.render(sets=["models.source=none", "proposer.initContainers[0].name=wait",
                             "proposer.initContainers[0].image=busybox"])
    assert [c["name"] for c in pod_spec(docs, "proposer")["initContainers"]] == ["wait"]
    assert "initContainers" not in pod_spec(docs, "scorer")


# Scaling ---------------------------------------------------------------------------------------


def test_keda_scales_the_scorer_on_waiting_requests(rendered):
    docs = rendered["cluster-fit"]
    (scaled,) = of_kind(docs, "ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": component_name("scorer")}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["query"] == (
        f'sum(specdecode_waiting_requests{{namespace="{NAMESPACE}", job=~"sd-specdecode-.*"}})')
    assert trigger["metadata"]["threshold"] == "4"
    assert "replicas" not in deployment(docs, "scorer")["spec"], "KEDA's HPA owns the replicas"
    assert not of_kind(docs, "HorizontalPodAutoscaler")


def test_orchestrator_custom_metric_only_with_the_adapter(helm):
    cpu = ["orchestrator.autoscaling.enabled=true", "orchestrator.autoscaling.targetCPUUtilizationPercentage=70"]
    (hpa,) = of_kind(helm.render(sets=cpu), "HorizontalPodAutoscaler")
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Resource"]
    (hpa,) = of_kind(helm.render(sets=[*cpu, "prometheusAdapter.enabled=true"]), "HorizontalPodAutoscaler")
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Pods", "Resource"]


@pytest.mark.parametrize("sets,message", [
    (["orchestrator.autoscaling.enabled=true"],
     "runningSequencesPerPod needs prometheusAdapter.enabled=true"),
    (["scorer.autoscaling.enabled=true", "scorer.autoscaling.mode=hpa"],
     "scorer.autoscaling.mode is hpa, whose External metric needs prometheusAdapter.enabled=true"),
    (["scorer.autoscaling.enabled=true", "scorer.autoscaling.minReplicas=0"],
     "scorer.autoscaling.minReplicas: Must be greater than or equal to 1"),
    (["scorer.autoscaling.enabled=true", "scorer.autoscaling.mode=vpa"], "scorer.autoscaling.mode must be one of"),
])
def test_scaling_that_cannot_work_is_refused(helm, sets, message):
    assert message in helm.template_fails(sets=sets)
