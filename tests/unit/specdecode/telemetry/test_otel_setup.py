"""OpenTelemetry set-up (specdecode/telemetry/otel_setup.py): nothing without configuration, the
exporters chosen from the environment, the resource, and the Prometheus -> OTLP
metrics conversion."""

from __future__ import annotations

import json
import math

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
import pytest
from opentelemetry import trace

from specdecode.telemetry import otel_setup, tracing
from specdecode.telemetry.served_metrics import ModelNameLabel

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}


# -- set-up ---------------------------------------------------------------------------------

@pytest.mark.parametrize("env", [
    {},
    # What the Helm chart sets when no endpoint is configured.
    {"OTEL_SERVICE_NAME": "specdecode-scorer", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
     "OTEL_TRACES_SAMPLER_ARG": "1.0", "OTEL_TRACES_EXPORTER": "none",
     "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=p"},
    {**ENDPOINT, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"},
    {**ENDPOINT, "OTEL_SDK_DISABLED": "true"},
])
def test_unconfigured_creates_nothing_and_prints_nothing(env, capfd):
    before = trace.get_tracer_provider()
    t = otel_setup.configure("scorer", env=env)
    assert t.tracer_provider is None and t.metrics_bridge is None and not t.tracing
    assert trace.get_tracer_provider() is before
    assert not tracing.enabled()
    with tracing.child_span("x") as span:  # the library's spans are no-ops
        assert not span.is_recording()
    t.shutdown()
    out = capfd.readouterr()
    assert out.out == "" and out.err == ""


def test_exporter_choice():
    assert otel_setup.trace_exporter_names(ENDPOINT) == ["otlp"]
    assert otel_setup.trace_exporter_names({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "x"}) == ["otlp"]
    assert otel_setup.trace_exporter_names({}, console=True) == ["console"]
    assert otel_setup.trace_exporter_names(ENDPOINT, console=True) == ["otlp", "console"]
    assert otel_setup.trace_exporter_names({"OTEL_TRACES_EXPORTER": "console"}) == ["console"]
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER: 'zipkin'"):
        otel_setup.trace_exporter_names({"OTEL_TRACES_EXPORTER": "zipkin"})
    assert otel_setup.metrics_exporter_enabled(ENDPOINT)
    assert not otel_setup.metrics_exporter_enabled({})
    assert not otel_setup.metrics_exporter_enabled({**ENDPOINT, "OTEL_METRICS_EXPORTER": "none"})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        otel_setup.configure("scorer", env={**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
                            set_global=False)
    # Both protocols the chart offers (otel.protocol) have their exporter installed.
    for protocol, module in (("grpc", "grpc"), ("http/protobuf", "http")):
        env = {**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
        for signal in ("TRACES", "METRICS"):
            exporter = otel_setup._otlp_exporter(env, signal)
            assert type(exporter).__module__.startswith(
                f"opentelemetry.exporter.otlp.proto.{module}."), (protocol, signal)


def test_configured_provider_resource_and_console(capfd):
    env = {**ENDPOINT, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "sd-proposer",
           "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,team=a%20b"}
    t = otel_setup.configure("proposer", console=True, env=env, set_global=False)
    try:
        attrs = t.tracer_provider.resource.attributes
        assert attrs["service.name"] == "sd-proposer"
        assert attrs["deployment.environment"] == "test" and attrs["team"] == "a b"
        assert attrs["specdecode.role"] == "proposer"
        assert t.metrics_bridge is not None  # an endpoint alone turns OTLP metrics on
        t.tracer_provider.get_tracer("t").start_span("hello").end()
    finally:
        t.metrics_bridge.exporter.shutdown()  # never started: nothing to flush
        t.metrics_bridge = None
        t.shutdown()
    printed = capfd.readouterr().out
    assert json.loads(printed)["name"] == "hello"
    default = otel_setup.build_resource("scorer", {})
    assert default.attributes["service.name"] == "specdecode-scorer"


# -- Prometheus -> OTLP ---------------------------------------------------------------------

def test_prometheus_registry_converts_to_otlp_metrics():
    registry = prometheus_client.CollectorRegistry()
    c = prometheus_client.Counter("specdecode_things", "Things.", ["kind"], registry=registry)
    g = prometheus_client.Gauge("specdecode_level", "Level.", registry=registry)
    h = prometheus_client.Histogram("specdecode_wait_seconds", "Wait.", buckets=(0.1, 1.0),
                                    registry=registry)
    prometheus_client.Counter("other_total", "Not ours.", registry=registry).inc()
    c.labels("a").inc(3)
    g.set(float("nan"))
    for v in (0.05, 0.5, 0.7, 5.0):
        h.observe(v)
    metrics = {m.name: m for m in otel_setup.prometheus_to_otlp(registry, start_time_ns=1)}
    assert set(metrics) == {"specdecode_things", "specdecode_level", "specdecode_wait_seconds"}
    (point,) = metrics["specdecode_things"].data.data_points
    assert metrics["specdecode_things"].data.is_monotonic
    assert point.value == 3 and point.attributes == {"kind": "a"}
    assert point.start_time_unix_nano == 1
    assert math.isnan(metrics["specdecode_level"].data.data_points[0].value)
    (hp,) = metrics["specdecode_wait_seconds"].data.data_points
    assert list(hp.explicit_bounds) == [0.1, 1.0] and list(hp.bucket_counts) == [1, 2, 1]
    assert hp.count == 4 and hp.sum == pytest.approx(6.25)
    # a ModelNameLabel view (what /metrics serves) gives every point its model_name
    view = ModelNameLabel(registry)
    view.model_name = "m"
    labelled = otel_setup.prometheus_to_otlp(view, start_time_ns=1)
    assert {p.attributes.get("model_name") for m in labelled for p in m.data.data_points} == {"m"}
    # the view labels copies: a collector that hands out the same family each time (as
    # python_info does) keeps its own samples, so a later model_name is not shadowed
    families = [GaugeMetricFamily("specdecode_fixed", "Fixed.", 1.0)]
    registry.register(type("Fixed", (), {"collect": lambda self: families})())
    list(view.collect())
    view.model_name = "later"
    assert families[0].samples[0].labels == {}
    fixed = [f for f in view.collect() if f.name == "specdecode_fixed"]
    assert fixed[0].samples[0].labels == {"model_name": "later"}
    # and the OTLP encoder accepts them
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    data = MetricsData([ResourceMetrics(Resource.create({}), [ScopeMetrics(
        InstrumentationScope("s"), list(metrics.values()), "")], "")])
    encoded = encode_metrics(data)
    names = {m.name for m in encoded.resource_metrics[0].scope_metrics[0].metrics}
    assert names == set(metrics)
