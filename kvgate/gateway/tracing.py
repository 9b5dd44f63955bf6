"""The gateway's span for each request, where tracing is on (`--otel-endpoint`, or the standard
OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT): a SERVER span under the caller's W3C `traceparent` header, current while the
request runs, so every job the request enqueues carries it as its traceparent (producer/tracing.py) and the
workers' spans for those jobs (worker/tracing.py) hang under it. The gateway keeps its own tracer provider: it never
sets OpenTelemetry's global one, which belongs to the application around it."""
from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.worker.tracing import make_provider, tracing_endpoint

UNTRACED = ("/health", "/metrics")  # probes and scrapes: many, and nobody's request


def request_tracer(endpoint_flag: str | None, exporter: Any = None) -> Any | None:
    """The tracer of the gateway's request spans, or None where tracing is off (no exporter given)."""
    if tracing_endpoint(endpoint_flag) is None and exporter is None:
        return None
    provider, _ = make_provider("kvgate-gateway", exporter, endpoint_flag)
    return provider.get_tracer("kvgate.gateway")


class TracingMiddleware:
    """A span per HTTP request: `POST /v1/chat/completions`, with the HTTP semantic conventions' attributes."""

    def __init__(self, app: ASGIApp, tracer: Any) -> None:
        from opentelemetry import propagate, trace
        self.app, self.tracer, self.trace, self.propagate = app, tracer, trace, propagate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"traceparent", b"tracestate")}
        method = scope["method"]
        span = self.tracer.start_span(f"{method} {scope['path']}", self.propagate.extract(headers),
                                      kind=self.trace.SpanKind.SERVER,
                                      attributes={"http.request.method": method, "url.path": scope["path"]})

        async def answered(message: Message) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
                if message["status"] >= 500:
                    span.set_status(self.trace.Status(self.trace.StatusCode.ERROR))
            await send(message)

        with self.trace.use_span(span, end_on_exit=True):
            await self.app(scope, receive, answered)
