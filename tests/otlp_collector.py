"""An OpenTelemetry collector stand-in for the tracing tests: a real OTLP/HTTP receiver on loopback that decodes the
protobuf payloads the SDK's exporter sends, as a collector would, and keeps every span."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Collector:
    """An OTLP/HTTP traces receiver: every span it was sent, as (name, trace id, span id, parent, attributes, links)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            collector.spans.append({
                                "name": span.name, "kind": span.kind, "trace": span.trace_id.hex(),
                                "id": int.from_bytes(span.span_id),
                                "parent": int.from_bytes(span.parent_span_id) if span.parent_span_id else None,
                                "attributes": {a.key: a.value for a in span.attributes},
                                "links": [int.from_bytes(link.span_id) for link in span.links]})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def named(self, name: str) -> list[dict]:
        return [s for s in list(self.spans) if s["name"] == name]
