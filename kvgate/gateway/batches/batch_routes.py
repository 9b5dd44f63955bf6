"""/v1/batches: create a batch over an uploaded file, read it, list them, cancel one. The runner does the work."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvgate.openai.batch import CHAT, COMPLETIONS, RESPONSES
from kvgate.openai.completion_window import BadWindow, window_seconds
from kvgate.openai.embeddings import EMBEDDINGS

from ..auth import Caller
from ..errors import ApiError, invalid
from ..json_answer import json_response
from ..paging import limit_of, page_body
from ..request_body import read_json
from ..settings import GatewaySettings
from .batch_runner import BatchRunner
from .batch_store import Batch, BatchStore, new_batch_id
from .expires_after import expiry_seconds
from .file_routes import FilesApi

ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES)
CANCELLABLE = ("validating", "in_progress")
MAX_METADATA = 16


@dataclass(slots=True)
class BatchesApi:
    settings: GatewaySettings
    files: FilesApi
    store: BatchStore | None = None  # set, with the runner, once the gateway's Redis client has started
    runner: BatchRunner | None = None

    def routes(self) -> list[Route]:
        return [Route("/v1/batches", self.create, methods=["POST"]),
                Route("/v1/batches", self.list, methods=["GET"]),
                Route("/v1/batches/{batch_id}", self.retrieve, methods=["GET"]),
                Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        caller = self.files.keys.caller(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise invalid("body", "the request body must be a JSON object")
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise invalid("endpoint",
                          f"endpoint={endpoint!r} is not supported; use one of {', '.join(ENDPOINTS)}",
                          code="invalid_endpoint")
        try:
            window_s = window_seconds(window, min_s=self.settings.batch_min_window_s)
        except BadWindow as e:
            raise invalid("completion_window", str(e)) from None
        metadata = _metadata(body.get("metadata"))
        output_expires_s = expiry_seconds(body.get("output_expires_after"), "output_expires_after",
                                          self.settings.file_min_expiry_s)
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            raise invalid("input_file_id", f"input_file_id={file_id!r} must be the id of an uploaded file")
        source = await self.files.found(file_id, caller, "input_file_id")
        if source.purpose != "batch":
            raise invalid("input_file_id", f"file {file_id} has purpose {source.purpose!r}; upload the input "
                                           "with purpose 'batch'")
        now = await self.store.now()  # the Redis server's clock, which judges the batch's expiry on every replica
        # the batch is its input's owner's (an admin's batch on a tenant's file too): its jobs carry that tenant
        batch = Batch(new_batch_id(), endpoint, file_id, now, now + window_s, completion_window=window,
                      metadata=metadata, tenant=source.tenant, output_expires_s=output_expires_s)
        await self.store.create(batch)
        self.runner.wake()
        return json_response(batch.body())

    async def retrieve(self, request: Request) -> Response:
        caller = self.files.keys.caller(request)
        return json_response((await self.found(request.path_params["batch_id"], caller)).body())

    async def list(self, request: Request) -> Response:
        caller = self.files.keys.caller(request)
        batches, more = await self.store.page(limit_of(request, 20, 100), request.query_params.get("after"),
                                              tenant=None if caller.admin else caller.tenant)
        return json_response(page_body([b.body() for b in batches], more))

    async def cancel(self, request: Request) -> Response:
        caller = self.files.keys.caller(request)
        batch = await self.found(request.path_params["batch_id"], caller)
        if batch.status not in CANCELLABLE + ("cancelling", "cancelled"):
            raise ApiError(409, f"batch {batch.id} is {batch.status}; only a validating or in_progress batch can be "
                                "cancelled", code="batch_not_cancellable")
        await self.store.transition(batch.id, CANCELLABLE, "cancelling", cancelling_at=await self.store.now())
        self.runner.wake()
        return json_response((await self.found(batch.id, caller)).body())

    async def found(self, batch_id: str, caller: Caller) -> Batch:
        """The batch, if `caller` may see it; another tenant's batch is answered as one that does not exist."""
        batch = await self.store.get(batch_id)
        if batch is None or not caller.sees(batch.tenant):
            raise ApiError(404, f"no batch with id {batch_id!r}", code="batch_not_found")
        return batch


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, string values up to 512."""
    if value is None:
        return None
    ok = isinstance(value, dict) and len(value) <= MAX_METADATA and all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items())
    if not ok:
        raise invalid("metadata", "metadata must be an object of at most 16 string pairs (keys up to 64 characters, "
                                  "values up to 512)")
    return value
