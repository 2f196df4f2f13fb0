"""The process's metrics as they leave it: every sample of the Prometheus registry with a
`model_name` label (vLLM's convention). /metrics (specdecode.serving.server) and the OTLP push
(specdecode.telemetry.otel_setup) both read `SERVED`, so both carry the same names and labels."""

from __future__ import annotations

import copy

import prometheus_client


class ModelNameLabel:
    """A collector: every sample of `registry` with a `model_name` label, the name of the
    served model (set once it is loaded; "" before)."""

    def __init__(self, registry: prometheus_client.CollectorRegistry = prometheus_client.REGISTRY):
        self.registry, self.model_name = registry, ""

    def collect(self):
        for family in self.registry.collect():
            # A copy: some collectors (python_info) hand out the same family every time.
            labelled = copy.copy(family)
            labelled.samples = [s._replace(labels={"model_name": self.model_name, **s.labels})
                                for s in family.samples]
            yield labelled


SERVED = ModelNameLabel()  # one per process, as prometheus_client.REGISTRY; one server each
