"""The Starlette app: routes, and the one AsyncClient (one reply stream) each gateway process holds."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.middleware import Middleware
from starlette.routing import Route

from kvgate import __version__
from kvgate.producer import AsyncClient, AsyncJobHandle, KvgateError, Result
from kvgate.producer.model_set import add_models
from kvgate.producer.steps import run_async

from . import sse
from .auth import Caller
from .batch_runner import BatchRunner
from .batch_store import BatchStore
from .batches import BatchesApi
from .embeddings import EmbeddingsApi
from .errors import ApiError, api_error_handler, from_sdk, http_error_handler, unexpected_error_handler
from .file_store import LocalFileStore, default_files_dir, namespace_dir
from .files import FilesApi
from .metrics import GatewayMetrics, MetricsMiddleware
from .middleware import middleware
from .models import LiveModels, model_object
from .request_body import read_json as _body, sized
from .responses import Reply, failure
from .responses_api import ResponsesApi
from .settings import GatewaySettings
from .tokenize import TokenizerApi
from .translate import Kind, Plan, plan

DISCONNECT_POLL_S = 1.0
CLOSE_TIMEOUT_S = 5.0
QUOTA_LEASE_MARGIN_S = 60  # a job holds its tenant's slot this long past the request timeout should its replica die


async def close_client(client: AsyncClient) -> None:
    """AsyncClient.close() can hang while its reader task sits in a blocking XREAD: bound it, so a stopping
    gateway never waits forever (the reply stream expires on its own)."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(client.close(), CLOSE_TIMEOUT_S)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")


class Gateway:
    """Per-process state: the SDK client and the model list; no job state beyond requests in flight."""

    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.client: AsyncClient | None = None
        self.models: LiveModels | None = None
        self._cancelling: set[asyncio.Task] = set()
        self.keys = settings.api_key_table()
        files_dir = namespace_dir(settings.files_dir or default_files_dir(), settings.namespace)
        self.files = FilesApi(settings, LocalFileStore(files_dir), self.keys)
        self.batches = BatchesApi(settings, self.files)
        self.metrics = GatewayMetrics()
        self.tokenizer = TokenizerApi(self)
        self.responses = ResponsesApi(self)
        self.embeddings = EmbeddingsApi(self)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        s = self.settings
        self.client = AsyncClient(s.redis_url, s.namespace, max_backlog=s.max_backlog, backpressure="raise",
                                  durability=s.durability, pool_size=s.redis_pool_size,
                                  pool_timeout_s=s.request_timeout_s, quota=s.quota_table(),
                                  quota_lease_s=s.request_timeout_s + QUOTA_LEASE_MARGIN_S)
        await self.client.start()
        if s.models:  # the operator's --model: known to the fleet (stats, the exporter, other gateways) from now on
            await run_async(add_models(self.client.redis, self.client.keys, s.models))
        self.models = LiveModels(self.client.redis, self.client.keys, s.models_cache_s, s.models)
        store = BatchStore(self.client.redis, self.client.keys.prefix)  # a cluster's shard 0: batch scripts, one slot
        runner = BatchRunner(self.client, store, self.files.store, window=s.batch_window, priority=s.batch_priority,
                             lease_s=s.batch_lease_s, poll_s=s.batch_poll_s, max_backlog=s.max_backlog,
                             models=self.models)
        self.batches.store, self.batches.runner = store, runner
        runner.start()
        try:
            yield
        finally:
            await runner.stop()
            await self.models.close()
            await close_client(self.client)

    # -- routes -----------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self.complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, "completion")

    async def complete(self, request: Request, kind: Kind) -> Response:
        caller = self.keys.caller(request)
        p = await sized(request, plan, kind, await _body(request), self.settings)  # a large body's checks: off the loop
        await self.models.check(p.model)
        if p.fill_in_middle:
            await self.models.check_fim(p.model)
        handles = await self.submit(p, caller)
        reply = Reply(p, f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{handles[0].job_id}",
                      served=await self.models.served_as(p.model))
        headers = {"x-request-id": handles[0].job_id}
        if p.stream:
            events = sse.events(reply, handles, self.settings.request_timeout_s, self.abandon)
            events = self.metrics.stream(events, request.state.kvgate_route, request.state.kvgate_started,
                                         preamble=len(handles) if kind == "chat" else 0)
            return StreamingResponse(events, media_type="text/event-stream", headers=sse.HEADERS | headers)
        results = await self.wait(request, handles)
        for r in results:
            error = failure(r)
            if error is not None:
                raise error
        return json_response(reply.body(results), headers=headers)

    async def list_models(self, request: Request) -> Response:
        self.keys.caller(request)
        models = await self.models.get()
        return json_response({"object": "list", "data": [model_object(m) for _, m in sorted(models.items())]})

    async def get_model(self, request: Request) -> Response:
        self.keys.caller(request)
        name = request.path_params["model"]
        model = (await self.models.get()).get(name)
        if model is None:
            raise ApiError(404, f"model {name!r} is not served by any live worker and has no jobs waiting",
                           param="model", code="model_not_found")
        return json_response(model_object(model))

    async def health(self, request: Request) -> Response:
        try:
            await self.client.redis.ping()
        except Exception as e:  # the load balancer should route elsewhere while Redis is unreachable
            raise ApiError(503, f"redis unreachable: {e}", type="server_error", code="queue_unavailable") from None
        return json_response({"status": "ok"})

    async def version(self, request: Request) -> Response:
        """vLLM's GET /version; open, as /health is."""
        return json_response({"version": __version__})

    async def prometheus(self, request: Request) -> Response:
        """The gateway's own metrics (metrics.py); open, as /health is, for Prometheus to scrape."""
        body, media_type = self.metrics.exposition()
        return Response(body, media_type=media_type)

    # -- jobs -------------------------------------------------------------------------------------
    async def submit(self, p: Plan, caller: Caller) -> list[AsyncJobHandle]:
        """Enqueue the plan's jobs as the caller's tenant's."""
        try:  # one request, one admission: all its jobs (choices, prompts) or none (chunk_size=None)
            return await self.client.submit_many([{**s, "tenant": caller.tenant} for s in p.submits], progress=False,
                                                 chunk_size=None)
        except KvgateError as e:  # an error about all its jobs names what made them many: prompts, or choices
            many = {"requests": "prompt" if len(set(p.prompt_of)) > 1 else "n"}
            raise from_sdk(e, many | p.names, self.settings.retry_after_s) from None

    async def wait(self, request: Request, handles: list[AsyncJobHandle]) -> list[Result]:
        """All results, or a 504 at the request timeout; jobs of a client that hung up are cancelled."""
        timeout = self.settings.request_timeout_s
        gathered = asyncio.ensure_future(asyncio.gather(*(h.result(timeout) for h in handles)))
        try:
            while True:
                done, _ = await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S)
                if done:
                    return gathered.result()
                if await request.is_disconnected():
                    raise ApiError(499, "client closed the request", code="client_closed")
        except KvgateError as e:
            raise from_sdk(e, {}, self.settings.retry_after_s) from None
        finally:
            gathered.cancel()
            unfinished = [h for h in handles if not h.done()]
            if unfinished:
                self.abandon(unfinished)

    def abandon(self, handles: list[AsyncJobHandle]) -> None:
        """Cancel jobs nobody waits for any more, in a task of its own: the request's task may be cancelled."""
        task = asyncio.get_running_loop().create_task(self._cancel(handles))
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    async def _cancel(self, handles: list[AsyncJobHandle]) -> None:
        for h in handles:
            with contextlib.suppress(Exception):
                await h.cancel()


def create_app(settings: GatewaySettings | None = None) -> Starlette:
    gw = Gateway(settings or GatewaySettings())
    routes = [
        Route("/v1/chat/completions", gw.chat, methods=["POST"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
        Route("/v1/models", gw.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", gw.get_model, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/version", gw.version, methods=["GET"]),
        Route("/metrics", gw.prometheus, methods=["GET"]),
        *gw.files.routes(),
        *gw.batches.routes(),
        *gw.tokenizer.routes(),
        *gw.responses.routes(),
        *gw.embeddings.routes(),
    ]
    handlers = {ApiError: api_error_handler, HTTPException: http_error_handler, Exception: unexpected_error_handler}
    counted = Middleware(MetricsMiddleware, metrics=gw.metrics, routes=routes)  # outermost: counts every answer
    app = Starlette(routes=routes, middleware=[counted, *middleware(gw.settings)], exception_handlers=handlers,
                    lifespan=gw.lifespan)
    app.state.gateway = gw
    return app
