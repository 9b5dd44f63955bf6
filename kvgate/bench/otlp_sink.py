"""An OTLP/HTTP receiver for benchmarks with tracing on: it takes each export the SDK's exporter sends, counts its
requests and bytes, and answers 200, as a collector would, so the traced run pays for making, batching, encoding and
sending every span, and nothing is stored. The tracing tests read what it receives (`keep`)."""
from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class OtlpSink:
    """`keep`: called with each export's body (protobuf), on the receiver's thread; None: bodies are dropped."""

    def __init__(self, keep: Callable[[bytes], None] | None = None) -> None:
        self.requests = self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size)
                if keep is not None:
                    keep(body)
                sink.requests, sink.bytes = sink.requests + 1, sink.bytes + size
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, name="otlp-sink", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
