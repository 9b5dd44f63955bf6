"""The Starlette app: one folder per API (chat, responses, embeddings, batches, vllm), each with its routes over the
one Serving object (serving.py), composed here with the routes of the gateway itself (models, health, metrics), and
the one AsyncClient (one reply stream) each gateway process holds."""
from __future__ import annotations

import asyncio
import contextlib

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvgate.producer import AsyncClient
from kvgate.producer.model_set import add_models
from kvgate.producer.steps import run_async

from .batches.batch_routes import BatchesApi
from .batches.batch_runner import BatchRunner
from .batches.batch_store import BatchStore
from .batches.file_routes import FilesApi
from .batches.file_store import LocalFileStore, default_files_dir, namespace_dir
from .chat.routes import ChatApi
from .embeddings.routes import EmbeddingsApi
from .errors import ApiError, api_error_handler, http_error_handler, unexpected_error_handler
from .json_answer import json_response
from .metrics import GatewayMetrics, MetricsMiddleware
from .middleware import middleware
from .models import LiveModels, model_object
from .responses.routes import ResponsesApi
from .serving import Serving
from .settings import GatewaySettings
from .vllm.lora_routes import LoraRoutes
from .vllm.routes import VllmApi
from .webhooks.outbox import Outbox, WebhookKeys
from .webhooks.sender import Timing, WebhookSender
from .webhooks.targets import Listen

CLOSE_TIMEOUT_S = 5.0
QUOTA_LEASE_MARGIN_S = 60  # a job holds its tenant's slot this long past the request timeout should its replica die


async def close_client(client: AsyncClient) -> None:
    """AsyncClient.close() can hang while its reader task sits in a blocking XREAD: bound it, so a stopping
    gateway never waits forever (the reply stream expires on its own)."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(client.close(), CLOSE_TIMEOUT_S)


class Gateway:
    """Per-process state: the SDK client and the model list (in `serving`); no job state beyond requests in flight."""

    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.serving = Serving(settings, settings.api_key_table(), GatewayMetrics())
        files_dir = namespace_dir(settings.files_dir or default_files_dir(), settings.namespace)
        self.files = FilesApi(settings, LocalFileStore(files_dir), self.serving.keys)
        self.batches = BatchesApi(settings, self.files)
        self.responses = ResponsesApi(self.serving)
        self.apis = (ChatApi(self.serving), self.files, self.batches, VllmApi(self.serving), LoraRoutes(self.serving),
                     self.responses, EmbeddingsApi(self.serving))
        self.webhook_targets = settings.webhook_targets()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        s, serving = self.settings, self.serving
        client = serving.client = AsyncClient(
            s.redis_url, s.namespace, max_backlog=s.max_backlog, backpressure="raise", durability=s.durability,
            pool_size=s.redis_pool_size, pool_timeout_s=s.request_timeout_s, quota=s.quota_table(),
            quota_lease_s=s.request_timeout_s + QUOTA_LEASE_MARGIN_S)
        await client.start()
        if s.models:  # the operator's --model: known to the fleet (stats, the exporter, other gateways) from now on
            await run_async(add_models(client.redis, client.keys, s.models))
        models = serving.models = LiveModels(client.redis, client.keys, s.models_cache_s, s.models)
        targets = self.webhook_targets
        wants = (lambda tenant: targets.of(tenant) is not None) if targets.any else None  # has it a receiver?
        # a cluster's shard 0: batch scripts, one slot, with the webhook outbox a final status writes to
        store = BatchStore(client.redis, client.keys.prefix, webhooks=wants)
        outbox = None if wants is None else Outbox(client.redis, WebhookKeys(client.keys.prefix), wants)
        sender = None if outbox is None else self._webhook_sender(outbox)
        runner = BatchRunner(client, store, self.files.store, window=s.batch_window, priority=s.batch_priority,
                             lease_s=s.batch_lease_s, poll_s=s.batch_poll_s, max_backlog=s.max_backlog,
                             models=models)
        self.batches.store, self.batches.runner = store, runner
        self.files.clock = store.now  # files' created_at and expiry on the Redis server's clock, as batches'
        runner.start()
        if sender is not None:
            sender.start()
        try:
            yield
        finally:
            if sender is not None:
                await sender.stop()
            await runner.stop()
            await models.close()
            await close_client(client)

    def _webhook_sender(self, outbox: Outbox) -> WebhookSender:
        s, counter = self.settings, self.serving.metrics.webhooks
        self.responses.outbox = outbox
        timing = Timing(s.webhook_retry_s, s.webhook_backoff_s, s.webhook_timeout_s, s.webhook_poll_s)
        return WebhookSender(outbox, self.webhook_targets, timing, allow_private=s.webhook_allow_private,
                             listen=Listen(s.host, s.port), ended=self.responses.ended,
                             count=lambda outcome: counter.labels(outcome).inc())

    # -- the gateway's own routes -----------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        self.serving.keys.caller(request)
        models = await self.serving.models.get()
        return json_response({"object": "list", "data": [model_object(m) for _, m in sorted(models.items())]})

    async def get_model(self, request: Request) -> Response:
        self.serving.keys.caller(request)
        name = request.path_params["model"]
        model = (await self.serving.models.get()).get(name)
        if model is None:
            raise ApiError(404, f"model {name!r} is not served by any live worker and has no jobs waiting",
                           param="model", code="model_not_found")
        return json_response(model_object(model))

    async def health(self, request: Request) -> Response:
        try:
            await self.serving.client.redis.ping()
        except Exception as e:  # the load balancer should route elsewhere while Redis is unreachable
            raise ApiError(503, f"redis unreachable: {e}", type="server_error", code="queue_unavailable") from None
        return json_response({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        """The gateway's own metrics (metrics.py); open, as /health is, for Prometheus to scrape."""
        body, media_type = self.serving.metrics.exposition()
        return Response(body, media_type=media_type)


def create_app(settings: GatewaySettings | None = None) -> Starlette:
    gw = Gateway(settings or GatewaySettings())
    routes = [
        Route("/v1/models", gw.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", gw.get_model, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/metrics", gw.prometheus, methods=["GET"]),
        *(route for api in gw.apis for route in api.routes()),
    ]
    handlers = {ApiError: api_error_handler, HTTPException: http_error_handler, Exception: unexpected_error_handler}
    counted = Middleware(MetricsMiddleware, metrics=gw.serving.metrics, routes=routes)  # outermost: counts every answer
    app = Starlette(routes=routes, middleware=[counted, *middleware(gw.settings)], exception_handlers=handlers,
                    lifespan=gw.lifespan)
    app.state.gateway = gw
    return app
