"""What every API's routes share to serve a request through the queue: the caller's keys, the settings, the live
models, the SDK client and the gateway's metrics, and one way to submit jobs, wait for them and abandon them. The
routes depend on this object only, never on app.py, which composes them and opens the client at its start."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.requests import Request

from kvgate.producer import AsyncClient, AsyncJobHandle, KvgateError, Result

from .auth import ApiKeys
from .errors import ApiError, failure, from_sdk
from .metrics import GatewayMetrics
from .models import LiveModels
from .settings import GatewaySettings

DISCONNECT_POLL_S = 1.0


class Serving:
    """The client and the models exist from the gateway's start on (app.py's lifespan sets them); a route reads them
    when a request comes."""

    def __init__(self, settings: GatewaySettings, keys: ApiKeys, metrics: GatewayMetrics):
        self.settings, self.keys, self.metrics = settings, keys, metrics
        self.client: AsyncClient | None = None
        self.models: LiveModels | None = None
        self._cancelling: set[asyncio.Task] = set()

    async def submit(self, jobs: list[dict[str, Any]], names: dict[str, str]) -> list[AsyncJobHandle]:
        """Enqueue one request's jobs in one admission: all of them or none (chunk_size=None); an SDK error is the
        HTTP error that names the request's fields (`names`: the SDK's field -> the body's)."""
        try:
            return await self.client.submit_many(jobs, progress=False, chunk_size=None)
        except KvgateError as e:
            raise from_sdk(e, names, self.settings.retry_after_s) from None

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

    async def answers(self, request: Request, handles: list[AsyncJobHandle]) -> list[Result]:
        """As wait, every result an answer: the first that is not raises as the request's error."""
        results = await self.wait(request, handles)
        for result in results:
            if (error := failure(result)) is not None:
                raise error
        return results

    def abandon(self, handles: list[AsyncJobHandle]) -> None:
        """Cancel jobs nobody waits for any more, in a task of its own: the request's task may be cancelled."""
        task = asyncio.get_running_loop().create_task(self._cancel(handles))
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    async def _cancel(self, handles: list[AsyncJobHandle]) -> None:
        for h in handles:
            with contextlib.suppress(Exception):
                await h.cancel()
