"""A real HTTP receiver for webhook tests: http.server on a loopback port in a thread, recording every delivery
(headers and body) and answering with the status the test sets (`status`), or not at all for a while (`hang_s`)."""
from __future__ import annotations

import base64
import os
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai

from tests.support import free_port


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


@dataclass
class Delivery:
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    port: int = field(default_factory=free_port)
    status: int = 200
    hang_s: float = 0.0
    deliveries: list[Delivery] = field(default_factory=list)  # every request, answered or not
    server: ThreadingHTTPServer | None = None
    tls: ssl.SSLContext | None = None  # a server context: the receiver speaks https

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/hooks"

    def start(self) -> "Receiver":
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                receiver.deliveries.append(Delivery({k.lower(): v for k, v in self.headers.items()}, body))
                if receiver.hang_s:
                    time.sleep(receiver.hang_s)
                self.send_response(receiver.status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        if self.tls is not None:
            self.server.socket = self.tls.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True, name=f"receiver-{self.port}").start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def events(self, secret: str) -> list:
        """Every delivery verified and parsed by the official client, as a receiver would."""
        with openai.OpenAI(api_key="unused") as client:
            return [client.webhooks.unwrap(d.body, d.headers, secret=secret) for d in list(self.deliveries)]

    def wait(self, count: int = 1, timeout: float = 30.0) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        while len(self.deliveries) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.deliveries)} deliveries after {timeout:g}s, not {count}")
            time.sleep(0.05)
        return list(self.deliveries)
