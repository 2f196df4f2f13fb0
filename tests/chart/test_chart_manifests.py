"""What breaks deployments in practice, checked on the rendered manifests (parsed with PyYAML)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from chartlib import (
    CHART,
    EXAMPLES,
    NAMESPACE,
    ROOT,
    args_map,
    by_name,
    component_name,
    container,
    env_map,
    of_kind,
    pod_specs,
)

COMPONENTS = ("proposer", "scorer", "orchestrator")
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
ORCHESTRATOR_SERVICE = component_name("orchestrator")

# The CLI contract (`specdecode serve <component> --help`): the flags each server takes.
CLI_FLAGS = {
    "proposer": {"--model", "--device", "--dtype", "--deterministic", "--compile", "--compile-cache",
                 "--cost-cache", "--host", "--port", "--metrics-port",
                 "--grace-seconds", "--sequence-lease-seconds", "--max-message-mb", "--calibration-width"},
    "scorer": {"--model", "--device", "--dtype", "--deterministic", "--compile", "--compile-cache",
               "--cost-cache", "--scoring", "--host", "--port",
               "--metrics-port", "--grace-seconds", "--sequence-lease-seconds", "--max-message-mb",
               "--calibration-width"},
    "orchestrator": {"--proposer", "--scorer", "--tokenizer", "--num-speculative-tokens", "--host", "--port",
                     "--metrics-port", "--grace-seconds", "--max-message-mb", "--proposer-timeout",
                     "--scorer-timeout", "--scorer-retry-timeout", "--health-interval", "--resolve-interval",
                     "--http-port", "--keepalive-interval", "--keepalive-timeout",
                     "--stream-write-timeout"},
}


def deployment(docs, component):
    return by_name(docs, "Deployment", component_name(component))


def server(docs, component):
    return container(deployment(docs, component), component)


def all_containers(docs):
    for name, spec, _ in pod_specs(docs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield name, spec, c


# Services, ports, addresses --------------------------------------------------------------------


def test_every_service_selects_its_pods(rendered, value_set):
    docs = rendered[value_set]
    pods = pod_specs(docs)
    services = of_kind(docs, "Service")
    # An orchestrator exposed outside the cluster keeps its metrics on a ClusterIP Service of their own.
    public = by_name(docs, "Service", component_name("orchestrator"))["spec"].get("type", "ClusterIP")
    extra = [] if public == "ClusterIP" else [component_name("orchestrator") + "-metrics"]
    assert sorted(s["metadata"]["name"] for s in services) == sorted(
        [*(component_name(c) for c in COMPONENTS), *extra])
    for svc in services:
        selector = svc["spec"]["selector"]
        matched = [(name, spec) for name, spec, labels in pods
                   if all(labels.get(k) == v for k, v in selector.items())]
        component = svc["metadata"]["labels"]["app.kubernetes.io/component"]
        assert [n for n, _ in matched] == [component_name(component)], (svc["metadata"]["name"], selector)
        # Every Service port's named targetPort exists on the selected container.
        (_, spec), = matched
        names = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, port
            assert port["port"] == names[port["targetPort"]], "Service port differs from the container port"


def test_deployment_selectors_and_pdbs_match_pod_labels(rendered, value_set):
    docs = rendered[value_set]
    for d in of_kind(docs, "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pdbs = of_kind(docs, "PodDisruptionBudget")
    assert len(pdbs) == 3
    for pdb in pdbs:
        selected = [n for n, _, labels in pod_specs(docs)
                    if pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert selected == [pdb["metadata"]["name"]]
        assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"])


def test_probes_are_native_grpc_on_the_container_port(rendered, value_set):
    for component in COMPONENTS:
        c = server(rendered[value_set], component)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == int(args_map(c)["--port"])
        assert ports["metrics"] == int(args_map(c)["--metrics-port"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c[probe]
            assert set(p["grpc"]) == {"port", "service"}, "a grpc.health.v1 check, nothing else"
            assert p["grpc"]["port"] == ports["grpc"], f"{component} {probe} probes another port"


def test_startup_probe_allows_for_model_loading(rendered):
    for component in COMPONENTS:
        p = server(rendered["default"], component)["startupProbe"]
        budget = p["initialDelaySeconds"] + p["periodSeconds"] * p["failureThreshold"]
        assert budget >= (1200 if component == "scorer" else 600), (component, budget)


def test_orchestrator_reaches_the_services_by_dns_name_and_port(rendered, value_set):
    docs = rendered[value_set]
    flags = args_map(server(docs, "orchestrator"))
    for component in ("proposer", "scorer"):
        svc = by_name(docs, "Service", component_name(component))
        grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert flags[f"--{component}"] == f"{component_name(component)}.{NAMESPACE}.svc:{grpc_port}"
        assert int(args_map(server(docs, component))["--port"]) == grpc_port


def test_orchestrator_service_is_the_client_entry_point(rendered):
    svc = by_name(rendered["nvidia"], "Service", ORCHESTRATOR_SERVICE)
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    assert by_name(rendered["default"], "Service", ORCHESTRATOR_SERVICE)["spec"]["type"] == "ClusterIP"


# CLI flags -------------------------------------------------------------------------------------


def test_server_flags_follow_the_cli_contract(rendered, value_set):
    docs = rendered[value_set]
    for component in COMPONENTS:
        c = server(docs, component)
        assert c["args"][:2] == ["serve", component]
        assert "command" not in c, "the image's ENTRYPOINT (specdecode) runs the servers"
        assert set(args_map(c)) == CLI_FLAGS[component]
        assert all(isinstance(a, str) for a in c["args"])
    grace = {args_map(server(docs, c))["--grace-seconds"] for c in COMPONENTS}
    assert len(grace) == 1


def test_chart_flags_exist_in_the_real_cli():
    """The chart's flags and their fixed choices are options of `specdecode serve <component>`."""
    import click

    from specdecode_stack.cli import serve
    for component, flags in CLI_FLAGS.items():
        options = {o for p in serve.commands[component].params for o in p.opts}
        assert flags <= options, (component, flags - options)
    device = next(p for p in serve.commands["scorer"].params if "--device" in p.opts)
    assert isinstance(device.type, click.Choice) and {"cpu", "cuda", "npu"} <= set(device.type.choices)


def test_values_reach_the_flags(helm):
    docs = helm.render(sets=["speculation.numSpeculativeTokens=7", "grpc.maxMessageMb=128", "scorer.port=6000",
                             "proposer.model=/models/draft", "scorer.scoring=multi-query", "grpc.bindHost=::",
                             "numerics.deterministic=false", "sequenceLeaseSeconds=45", "numerics.compile=on"])
    assert args_map(server(docs, "orchestrator"))["--num-speculative-tokens"] == "7"
    assert args_map(server(docs, "proposer"))["--model"] == "/models/draft"
    assert args_map(server(docs, "orchestrator"))["--scorer"].endswith(":6000")
    assert args_map(server(docs, "scorer"))["--scoring"] == "multi-query"
    assert args_map(server(docs, "scorer"))["--deterministic"] == "off"
    assert args_map(server(docs, "proposer"))["--deterministic"] == "off"
    assert args_map(server(helm.render(), "scorer"))["--deterministic"] == "on"
    for component in ("proposer", "scorer"):  # compiled graphs kept on the /cache emptyDir
        assert args_map(server(docs, component))["--compile"] == "on"
        assert args_map(server(helm.render(), component))["--compile"] == "auto"
        assert args_map(server(docs, component))["--compile-cache"].startswith("/cache/")
        assert args_map(server(docs, component))["--cost-cache"].startswith("/cache/")
    assert {args_map(server(docs, c))["--sequence-lease-seconds"] for c in ("proposer", "scorer")} == {"45"}
    for component in ("proposer", "scorer"):  # their cost tables time every verify width
        assert args_map(server(docs, component))["--calibration-width"] == "8"
    for component in COMPONENTS:
        flags = args_map(server(docs, component))
        assert flags["--max-message-mb"] == "128" and flags["--host"] == "::"


def test_no_service_link_variables(rendered, value_set):
    # Docker-link variables (SPECDECODE_PROPOSER_PORT=tcp://...) would collide with SPECDECODE_* settings.
    for _, spec, _ in pod_specs(rendered[value_set]):
        assert spec["enableServiceLinks"] is False


# Scorer placement ------------------------------------------------------------------------------


def test_npu_scorer_by_default(rendered):
    docs = rendered["default"]
    spec = deployment(docs, "scorer")["spec"]["template"]["spec"]
    c = server(docs, "scorer")
    assert args_map(c)["--device"] == "npu"
    assert c["resources"]["limits"]["huawei.com/Ascend910"] == 1
    assert c["resources"]["requests"]["huawei.com/Ascend910"] == 1
    assert spec["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    env = env_map(c)
    assert env["ASCEND_RT_VISIBLE_DEVICES"]["value"] == "0"
    assert "/usr/local/Ascend/driver/lib64" in env["LD_LIBRARY_PATH"]["value"].split(":")
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD" not in env, "torch_npu must load on the NPU host"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for host_path in ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi"):
        assert mounts[host_path]["readOnly"] is True
        assert volumes[mounts[host_path]["name"]]["hostPath"]["path"] == host_path
    assert 1000 in spec["securityContext"]["supplementalGroups"]
    # Nothing else asks for an accelerator.
    for component in ("proposer", "orchestrator"):
        other = server(docs, component)
        assert set(other["resources"]["limits"]) == {"cpu", "memory"}
        assert env_map(other)["TORCH_DEVICE_BACKEND_AUTOLOAD"]["value"] == "0"
        assert "nodeSelector" not in deployment(docs, component)["spec"]["template"]["spec"]


def test_npu_scorer_values(rendered, helm):
    docs = rendered["npu-autoscale"]
    spec = deployment(docs, "scorer")["spec"]["template"]["spec"]
    assert spec["tolerations"] == [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}]
    assert "podAntiAffinity" in spec["affinity"]
    assert server(docs, "scorer")["image"] == "specdecode:0.1.0-npu"
    assert server(docs, "proposer")["image"] == "specdecode:0.1.0"
    docs = helm.render(sets=["scorer.accelerator.count=2", "scorer.accelerator.npu.resourceName=huawei.com/Ascend310P",
                             "scorer.nodeSelector.zone=a"])
    c = server(docs, "scorer")
    assert c["resources"]["limits"]["huawei.com/Ascend310P"] == 2
    assert "huawei.com/Ascend910" not in c["resources"]["limits"]
    assert env_map(c)["ASCEND_RT_VISIBLE_DEVICES"]["value"] == "0,1"
    assert deployment(docs, "scorer")["spec"]["template"]["spec"]["nodeSelector"] == {
        "accelerator": "huawei-Ascend910", "zone": "a"}


def test_nvidia_scorer(rendered):
    docs = rendered["nvidia"]
    spec = deployment(docs, "scorer")["spec"]["template"]["spec"]
    c = server(docs, "scorer")
    assert args_map(c)["--device"] == "cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert not any(k.startswith("huawei.com/") for k in c["resources"]["limits"])
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true", "kubernetes.io/arch": "amd64"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["runtimeClassName"] == "nvidia"
    assert not any(k.startswith("ASCEND") for k in env_map(c))
    assert not any("hostPath" in v for v in spec["volumes"])
    assert "supplementalGroups" not in spec["securityContext"]


def test_cpu_scorer_has_no_accelerator(rendered):
    docs = rendered["cpu"]
    spec = deployment(docs, "scorer")["spec"]["template"]["spec"]
    c = server(docs, "scorer")
    assert args_map(c)["--device"] == "cpu" and args_map(c)["--dtype"] == "float32"
    for section in ("requests", "limits"):
        assert set(c["resources"][section]) == {"cpu", "memory"}
    assert "nodeSelector" not in spec and "tolerations" not in spec and "runtimeClassName" not in spec
    assert not any(k.startswith("ASCEND") or k == "LD_LIBRARY_PATH" for k in env_map(c))
    assert env_map(c)["TORCH_DEVICE_BACKEND_AUTOLOAD"]["value"] == "0"
    assert not any("hostPath" in v for v in spec["volumes"])


def test_scorer_device_override(helm):
    docs = helm.render(sets=["scorer.device=auto"])
    assert args_map(server(docs, "scorer"))["--device"] == "auto"


# Grace period ----------------------------------------------------------------------------------


def test_termination_grace_exceeds_drain_grace(rendered, value_set):
    docs = rendered[value_set]
    for component in COMPONENTS:
        spec = deployment(docs, component)["spec"]["template"]["spec"]
        c = server(docs, component)
        drain = int(args_map(c)["--grace-seconds"])
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        assert spec["terminationGracePeriodSeconds"] > drain + int(pre_stop[1])


@pytest.mark.parametrize("drain,pre_stop,termination", [(30, 0, 30), (40, 0, 30), (20, 10, 30), (20, 5, 25)])
def test_grace_violation_fails_rendering(helm, drain, pre_stop, termination):
    err = helm.template_fails(sets=[f"drainGraceSeconds={drain}", f"preStopSleepSeconds={pre_stop}",
                                    f"terminationGracePeriodSeconds={termination}"])
    assert (f"terminationGracePeriodSeconds ({termination}) must be greater than drainGraceSeconds ({drain}) "
            f"+ preStopSleepSeconds ({pre_stop})" in err), err


def test_pre_stop_sleep_can_be_turned_off(helm):
    docs = helm.render(sets=["preStopSleepSeconds=0", "drainGraceSeconds=29"])
    for component in COMPONENTS:
        assert "lifecycle" not in server(docs, component)


# Schema ----------------------------------------------------------------------------------------


def test_schema_rejects_a_wrong_type(helm):
    err = helm.template_fails(set_strings=["proposer.replicaCount=2"])
    assert "values don't meet the specifications of the schema" in err, err
    assert "proposer.replicaCount: Invalid type. Expected: integer, given: string" in err, err


def test_schema_rejects_a_typo(helm):
    err = helm.template_fails(sets=["scorer.acelerator.type=cpu"])
    assert "scorer: Additional property acelerator is not allowed" in err, err
    err = helm.template_fails(sets=["replicaCount=2"])
    assert "Additional property replicaCount is not allowed" in err, err


@pytest.mark.parametrize("setting,message", [
    ("scorer.accelerator.type=tpu", "scorer.accelerator.type: scorer.accelerator.type must be one of the following"),
    ("securityContext.runAsUser=0", "securityContext.runAsUser: Must be greater than or equal to 1"),
    ("scorer.scoring=fast", "scorer.scoring: scorer.scoring must be one of the following"),
    ("proposer.port=70000", "proposer.port: Must be less than or equal to 65535"),
])
def test_schema_rejects_bad_values(helm, setting, message):
    err = helm.template_fails(sets=[setting])
    assert message in err, err


def _schema_nodes(schema, node):
    """The schema object for `node`, following local $refs."""
    while "$ref" in node:
        node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def test_schema_covers_every_value():
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(values, node, path):
        node = _schema_nodes(schema, node)
        if isinstance(values, dict) and "properties" in node:
            # `global` is shared with parent charts, which put their own keys there.
            assert node.get("additionalProperties") is False or path == "global", f"{path or 'root'}: typos would pass"
            for key, value in values.items():
                assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
                walk(value, node["properties"][key], f"{path}.{key}".lstrip("."))

    for values in [DEFAULTS] + [yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES.glob("*.yaml"))]:
        walk(values, schema, "")


# values.yaml comments --------------------------------------------------------------------------


def test_every_values_key_has_a_comment():
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()
    missing = []

    def walk(node, in_sequence):
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if not in_sequence:
                    line = key.start_mark.line
                    above = lines[line - 1].strip() if line > 0 else ""
                    if not above.startswith("#"):
                        missing.append(f"line {line + 1}: {lines[line].strip()}")
                walk(value, in_sequence)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                walk(item, True)  # entries of a list are data, described by the list's comment

    walk(yaml.compose(text), False)
    assert not missing, "values.yaml keys without a comment line above them:\n" + "\n".join(missing)


# Security context and resources ----------------------------------------------------------------

RESTRICTED_CONTAINER = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def test_every_pod_and_container_is_restricted(rendered, value_set):
    docs = rendered[value_set]
    pods = pod_specs(docs)
    assert len(pods) == 4  # three servers and the helm test pod
    for name, spec, _ in pods:
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0, name
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        assert "hostNetwork" not in spec and "hostPID" not in spec and "hostIPC" not in spec
    seen = 0
    for name, spec, c in all_containers(docs):
        seen += 1
        sc = c["securityContext"]
        assert RESTRICTED_CONTAINER.items() <= sc.items(), (name, c["name"], sc)
        assert sc["runAsUser"] == spec["securityContext"]["runAsUser"] == DEFAULTS["securityContext"]["runAsUser"]
        # Writable scratch space on emptyDirs, since the root filesystem is read-only.
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], (name, c["name"])
        if "HF_HOME" in env_map(c):
            cache = env_map(c)["HF_HOME"]["value"]
            root = next(p for p in mounts if cache.startswith(p + "/"))
            assert "emptyDir" in volumes[mounts[root]]
    assert seen >= 4


def test_every_container_has_requests_and_limits(rendered, value_set):
    for name, _, c in all_containers(rendered[value_set]):
        res = c["resources"]
        for section in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res[section]), (name, c["name"], section)


def test_image_pull_secrets_and_service_account(rendered):
    docs = rendered["nvidia"]
    (sa,) = of_kind(docs, "ServiceAccount")
    for name, spec, _ in pod_specs(docs):
        assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}], name
        assert spec["serviceAccountName"] == sa["metadata"]["name"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["image"].startswith("registry.example.com/specdecode:"), c["image"]
    assert "imagePullSecrets" not in deployment(rendered["default"], "scorer")["spec"]["template"]["spec"]


# Models ----------------------------------------------------------------------------------------


def _models_volume(docs, component):
    spec = deployment(docs, component)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    c = server(docs, component)
    mounts = [m for m in c["volumeMounts"] if m["name"] == "models"]
    return spec, volumes.get("models"), mounts


def test_models_from_an_init_container_into_an_emptydir(rendered):
    docs = rendered["default"]
    for component in ("scorer", "orchestrator"):
        spec, volume, (mount,) = _models_volume(docs, component)
        assert "emptyDir" in volume and mount["readOnly"] is True and mount["mountPath"] == "/models"
        (init,) = spec["initContainers"]
        init_mount = next(m for m in init["volumeMounts"] if m["name"] == "models")
        assert not init_mount.get("readOnly"), "the init container writes the models"
        env = env_map(init)
        assert env["SPECDECODE_COMPONENT"]["value"] == component and env["MODELS_DIR"]["value"] == "/models"
    # The n-gram proposer needs no model: no volume, no init container.
    spec, volume, mounts = _models_volume(docs, "proposer")
    assert volume is None and not mounts and "initContainers" not in spec


def test_models_from_an_existing_claim(rendered):
    docs = rendered["nvidia"]
    for component in COMPONENTS:
        spec, volume, (mount,) = _models_volume(docs, component)
        assert volume["persistentVolumeClaim"] == {"claimName": "specdecode-models", "readOnly": True}
        assert mount["readOnly"] is True and mount["subPath"] == "qwen2.5-coder"
        assert "initContainers" not in spec
        assert "hostPath" not in volume


def test_models_from_a_host_path(rendered):
    docs = rendered["npu-autoscale"]
    for component in COMPONENTS:
        _, volume, (mount,) = _models_volume(docs, component)
        assert volume["hostPath"] == {"path": "/data/models", "type": "Directory"}
        assert mount["readOnly"] is True


def test_models_baked_into_the_image(helm):
    docs = helm.render(sets=["models.source=none"])
    for component in COMPONENTS:
        spec, volume, mounts = _models_volume(docs, component)
        assert volume is None and not mounts and "initContainers" not in spec


@pytest.mark.parametrize("sets,message", [
    (["models.source=pvc"], "models.source is pvc but models.pvc.claimName is empty"),
    (["models.source=hostPath"], "models.source is hostPath but models.hostPath.path is empty"),
])
def test_incomplete_model_source_fails(helm, sets, message):
    assert message in helm.template_fails(sets=sets)


def test_model_paths_live_under_the_mount(rendered, value_set):
    docs = rendered[value_set]
    mount = DEFAULTS["models"]["mountPath"] + "/"
    paths = [args_map(server(docs, "scorer"))["--model"], args_map(server(docs, "orchestrator"))["--tokenizer"]]
    proposer_model = args_map(server(docs, "proposer"))["--model"]
    if proposer_model != "ngram":
        paths.append(proposer_model)
    for p in paths:
        assert p.startswith(mount), p


# Observability ---------------------------------------------------------------------------------


def test_opentelemetry_environment(rendered, value_set):
    docs = rendered[value_set]
    for component in COMPONENTS:
        env = env_map(server(docs, component))
        assert env["OTEL_SERVICE_NAME"]["value"] == f"specdecode-{component}"
        assert env["K8S_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["K8S_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        attrs = dict(kv.split("=", 1) for kv in env["OTEL_RESOURCE_ATTRIBUTES"]["value"].split(","))
        assert attrs["k8s.pod.name"] == "$(K8S_POD_NAME)" and attrs["k8s.namespace.name"] == "$(K8S_NAMESPACE)"
        assert attrs["k8s.deployment.name"] == component_name(component)
        # $(VAR) expands only for variables defined earlier in the list.
        names = [e["name"] for e in server(docs, component)["env"]]
        for ref in re.findall(r"\$\((\w+)\)", env["OTEL_RESOURCE_ATTRIBUTES"]["value"]):
            assert names.index(ref) < names.index("OTEL_RESOURCE_ATTRIBUTES")
        if value_set in ("nvidia", "npu-autoscale"):
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.observability:4317"
            assert "OTEL_TRACES_EXPORTER" not in env
        else:
            assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
            assert env["OTEL_TRACES_EXPORTER"]["value"] == "none"
    if value_set == "npu-autoscale":
        env = env_map(server(docs, "scorer"))
        assert "deployment.environment=production" in env["OTEL_RESOURCE_ATTRIBUTES"]["value"]
        assert env["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.1"


def test_prometheus_scrape_annotations(rendered, value_set):
    docs = rendered[value_set]
    for component in COMPONENTS:
        ann = deployment(docs, component)["spec"]["template"]["metadata"]["annotations"]
        c = server(docs, component)
        metrics = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
        assert ann == {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics),
                       "prometheus.io/path": "/metrics"}


def test_dashboard_configmap(rendered):
    assert not [d for d in of_kind(rendered["default"], "ConfigMap") if d["metadata"]["name"].endswith("dashboard")]
    (cm,) = of_kind(rendered["npu-autoscale"], "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["specdecode.json"])
    assert dashboard["uid"] and dashboard["title"]
    assert dashboard == json.loads((CHART / "dashboards" / "specdecode.json").read_text())


def test_chart_dashboard_is_a_copy_of_the_projects():
    chart_copy = CHART / "dashboards" / "specdecode.json"
    dashboard = json.loads(chart_copy.read_text())
    assert isinstance(dashboard.get("panels"), list)
    project = ROOT / "dashboards" / "specdecode.json"
    if project.exists():  # until it exists, the chart carries a placeholder
        assert chart_copy.read_text() == project.read_text(), (
            "helm/specdecode/dashboards/specdecode.json differs from dashboards/specdecode.json: "
            "cp dashboards/specdecode.json helm/specdecode/dashboards/")


# Scaling ---------------------------------------------------------------------------------------


def test_autoscaling(rendered):
    docs = rendered["npu-autoscale"]
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")}
    assert sorted(hpas) == sorted(component_name(c) for c in COMPONENTS)
    for name, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        assert "replicas" not in by_name(docs, "Deployment", name)["spec"], "the HPA owns replicas"
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert hpa["spec"]["metrics"]
    # The scorer on the requests waiting in the orchestrators, per replica (External metric).
    scorer = hpas[component_name("scorer")]["spec"]
    assert (scorer["minReplicas"], scorer["maxReplicas"]) == (3, 6)
    assert scorer["metrics"] == [{"type": "External", "external": {
        "metric": {"name": "specdecode_waiting_requests", "selector": {"matchLabels": {"namespace": NAMESPACE}}},
        "target": {"type": "AverageValue", "averageValue": "4"}}}]
    orchestrator = hpas[component_name("orchestrator")]
    # Scaled on its load (running sequences per pod), not on CPU.
    assert orchestrator["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "specdecode_running_sequences"},
        "target": {"type": "AverageValue", "averageValue": "32"}}}]
    assert orchestrator["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert not of_kind(rendered["default"], "HorizontalPodAutoscaler")
    assert by_name(docs, "PodDisruptionBudget", component_name("proposer"))["spec"] == {
        "minAvailable": 1, "selector": {"matchLabels": {
            "app.kubernetes.io/name": "specdecode", "app.kubernetes.io/instance": "sd",
            "app.kubernetes.io/component": "proposer"}}}


@pytest.mark.parametrize("sets,message", [
    (["orchestrator.autoscaling.enabled=true", "orchestrator.autoscaling.minReplicas=5",
      "orchestrator.autoscaling.maxReplicas=2"], "orchestrator.autoscaling.minReplicas (5) is greater than maxReplicas (2)"),
    (["proposer.pdb.minAvailable=1"], "proposer.pdb: set minAvailable or maxUnavailable, not both"),
])
def test_inconsistent_scaling_values_fail(helm, sets, message):
    assert message in helm.template_fails(sets=sets)


def test_scorer_rolls_without_a_spare_accelerator(rendered):
    strategy = deployment(rendered["default"], "scorer")["spec"]["strategy"]
    assert strategy["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


# Names -----------------------------------------------------------------------------------------


def test_long_release_names_stay_within_dns_limits(helm):
    helm_args = helm.template_args()
    helm_args[1] = "a-release-name-of-the-longest-length-helm-allows-53ch"
    docs = [d for d in yaml.safe_load_all(helm.run(*helm_args).stdout) if d]
    for d in docs:
        name = d["metadata"]["name"]
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name


def test_three_scorer_replicas_behind_headless_services(helm):
    """The proposer's and scorer's Services are headless, so their names resolve to every
    ready pod and the orchestrator routes to each as a replica; a budget keeps a scorer up."""
    docs = helm.render(sets=["scorer.replicaCount=3"])
    assert deployment(docs, "scorer")["spec"]["replicas"] == 3
    for component in ("proposer", "scorer"):
        svc = by_name(docs, "Service", component_name(component))
        assert svc["spec"]["clusterIP"] == "None" and "type" not in svc["spec"]
    assert by_name(docs, "Service", ORCHESTRATOR_SERVICE)["spec"]["type"] == "ClusterIP"
    flags = args_map(server(docs, "orchestrator"))
    assert flags["--scorer"] == f"{component_name('scorer')}.{NAMESPACE}.svc:50053"
    assert float(flags["--resolve-interval"]) <= 10, "pods that come and go are seen soon"
    pdb = by_name(docs, "PodDisruptionBudget", component_name("scorer"))["spec"]
    assert pdb["minAvailable"] == 1 and "maxUnavailable" not in pdb


def test_fault_settings_reach_the_orchestrator(helm):
    docs = helm.render(sets=["orchestrator.faults.proposerTimeoutSeconds=2",
                             "orchestrator.faults.scorerRetryTimeoutSeconds=45",
                             "orchestrator.faults.keepaliveIntervalSeconds=3",
                             "orchestrator.streamWriteTimeoutSeconds=20"])
    flags = args_map(server(docs, "orchestrator"))
    assert flags["--proposer-timeout"] == "2" and flags["--scorer-retry-timeout"] == "45"
    assert flags["--keepalive-interval"] == "3" and flags["--keepalive-timeout"] == "2.5"
    assert flags["--stream-write-timeout"] == "20"
    assert flags["--scorer-timeout"] == "0"  # sized from each step's work
