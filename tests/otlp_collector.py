"""An OpenTelemetry collector stand-in for the tracing tests: a real OTLP/HTTP receiver on loopback (the benchmarks'
sink) whose exports are decoded from protobuf as a collector would, keeping every span."""
from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvgate.bench.otlp_sink import OtlpSink


class Collector:
    """Every span it was sent, as (name, kind, trace id, span id, parent, attributes, links)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.sink = OtlpSink(keep=self._keep)
        self.url = self.sink.url

    def _keep(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self.spans.append({
                        "name": span.name, "kind": span.kind, "trace": span.trace_id.hex(),
                        "id": int.from_bytes(span.span_id),
                        "parent": int.from_bytes(span.parent_span_id) if span.parent_span_id else None,
                        "attributes": {a.key: a.value for a in span.attributes},
                        "links": [int.from_bytes(link.span_id) for link in span.links]})

    def named(self, name: str) -> list[dict]:
        return [s for s in list(self.spans) if s["name"] == name]
