"""The gateway's own Prometheus metrics (prefix `kvgate_gateway_`), served at GET /metrics.

Labels stay bounded: `route` is the matched route's template (`/v1/files/{file_id}`, never the id itself; a path
no route matches is `unmatched`), `status` an HTTP status code. No tenant and no model label: tenants are API keys'
and models are whatever producers name, so either would let callers grow the series without bound; the worker's
metrics carry the model and a capped tenant label (worker/metrics.py). 429s are `requests_total{status="429"}`.

Each GatewayMetrics owns its registry, so several gateways in one process (tests) do not clash on names.
"""
from __future__ import annotations

import time
from typing import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.worker.metrics import E2E_BUCKETS, TTFT_BUCKETS

UNMATCHED = "unmatched"
ERROR_FRAME = b'data: {"error"'


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvgate_gateway_requests", "HTTP requests answered, by route template and status",
                                ("route", "status"), registry=r)
        self.latency = Histogram("kvgate_gateway_request_duration_seconds", "Request arrival to the last byte of "
                                 "the answer (a stream's whole length), by route template", ("route",),
                                 buckets=E2E_BUCKETS, registry=r)
        self.in_flight = Gauge("kvgate_gateway_requests_in_flight", "Requests being answered now", registry=r)
        self.streams = Gauge("kvgate_gateway_open_streams", "Server-sent event streams open now", registry=r)
        self.ttft = Histogram("kvgate_gateway_time_to_first_token_seconds", "Request arrival to the first event "
                              "carrying a token of a streamed answer, by route template", ("route",),
                              buckets=TTFT_BUCKETS, registry=r)
        self.webhooks = Counter("kvgate_gateway_webhook_deliveries", "Webhook delivery attempts of this process, by "
                                "outcome: delivered, retried, failed (retry time over), dropped (no receiver for "
                                "its tenant)", ("outcome",), registry=r)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def stream(self, events: AsyncIterator[bytes], route: str, started: float,
                     preamble: int = 0) -> AsyncIterator[bytes]:
        """An SSE body counted as an open stream, its first token timed: the frame after `preamble` frames (a chat
        stream's role chunks come before any token); an error frame is no token."""
        self.streams.inc()
        seen = 0
        try:
            async for frame in events:
                if seen == preamble and not frame.startswith(ERROR_FRAME):
                    self.ttft.labels(route).observe(time.perf_counter() - started)
                seen += 1
                yield frame
        finally:
            self.streams.dec()


def route_of(routes: list[BaseRoute], scope: Scope) -> str:
    """The template of the route that answers `scope`; mounts are not used by this app."""
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return getattr(route, "path", UNMATCHED)
    return UNMATCHED


class MetricsMiddleware:
    """Counts and times every HTTP request. Pure ASGI, so a stream's body passes through untouched; the request's
    route and start time are put in scope["state"] for the route to read (`kvgate_route`, `kvgate_started`)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, routes: list[BaseRoute]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        m, started = self.metrics, time.perf_counter()
        route = route_of(self.routes, scope)
        scope.setdefault("state", {}).update(kvgate_route=route, kvgate_started=started)
        status = 500  # what an exception that escapes every handler becomes

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        m.in_flight.inc()
        try:
            await self.app(scope, receive, counted)
        finally:
            m.in_flight.dec()
            m.requests.labels(route, str(status)).inc()
            m.latency.labels(route).observe(time.perf_counter() - started)
