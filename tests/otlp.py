"""A real OTLP/gRPC receiver on loopback for tests (opentelemetry-proto's TraceService and
MetricsService), and readers of what it received."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer,
               metrics_service_pb2_grpc.MetricsServiceServicer):
    """An OTLP/gRPC collector that keeps what it is sent."""

    def __init__(self):
        self.traces: list = []
        self.metrics: list = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.traces.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()
        self.metrics.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    @property
    def env(self) -> dict[str, str]:
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "100",
                "OTEL_METRIC_EXPORT_INTERVAL": "1000"}


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attrs(pb) -> dict:
    return {a.key: value(a.value) for a in pb.attributes}


@dataclass
class Span:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent: str
    attributes: dict
    status: int
    links: list = field(default_factory=list)


def spans_of(receiver: Receiver) -> list[Span]:
    out = []
    for request in receiver.traces:
        for rs in request.resource_spans:
            service = attrs(rs.resource)["service.name"]
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(Span(service, s.name, s.kind, s.trace_id.hex(), s.span_id.hex(),
                                    s.parent_span_id.hex(), attrs(s), s.status.code,
                                    [link.span_id.hex() for link in s.links]))
    return out
