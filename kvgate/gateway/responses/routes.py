"""/v1/responses: OpenAI's Responses API over the queue. A response is one job, planned and submitted by the chat path
(a Responses body becomes a chat body: body.py), answered whole, as typed stream events, or in the
background (`background: true` answers at once, `queued`; the response id names the job, read back by GET and
stopped by cancel). Stored responses (store.py) let any replica answer GET, cancel and
previous_response_id; `store: false` keeps nothing, and its id then answers 404.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvgate.producer import AsyncJobHandle, JobStatus, KvgateError, Result
from kvgate.producer.job_status import job_states_script, job_status
from kvgate.producer.constraints import Tools
from kvgate.producer.steps import run_async

from ..auth import Caller
from ..chat import sse
from ..chat.plan import plan
from ..chat.routes import submit_plan
from ..errors import ApiError, failure, from_sdk, invalid, unsupported
from ..json_answer import json_response
from ..paging import limit_of, page_body
from ..request_body import read_json, sized
from ..serving import Serving
from .body import renamed, take
from .response_object import FINAL, ResponseEvents, ResponseView, job_of, response_id
from .store import Record, ResponseStore

CANCEL_WAIT_S = 5.0  # how long cancel waits for a running job to stop (a step or two) before it answers
CANCEL_POLL_S = 0.05
CONTINUABLE = ("completed", "incomplete")


def frame(event: dict[str, Any]) -> bytes:
    """The Responses API's SSE framing: the event's type as `event:`, no [DONE]."""
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


class ResponsesApi:
    def __init__(self, serving: Serving):
        self.serving = serving
        self._store: ResponseStore | None = None
        self._states = None
        self.outbox = None  # the webhook outbox (app.py) where webhooks are on: background responses are watched

    @property
    def store(self) -> ResponseStore:
        self._open()
        return self._store

    def _open(self) -> None:
        if self._store is None:
            client = self.serving.client
            self._store = ResponseStore(client.redis, client.keys, self.serving.settings.responses_ttl_s)
            self._states = job_states_script(client.redis)

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
                Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
                Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"])]

    # -- create -----------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        s = self.serving
        caller = s.keys.caller(request)
        body = await read_json(request)
        earlier = None
        if isinstance(body, dict) and body.get("previous_response_id") is not None:
            earlier = (await self.previous(body["previous_response_id"], caller)).conversation_after()
        asked = await sized(request, take, body, earlier)
        try:
            p = await sized(request, plan, "chat", asked.chat, s.settings)
        except ApiError as e:
            raise renamed(e) from None
        await s.models.check(p.model)
        (handle,) = await submit_plan(s, p, caller)
        view = ResponseView(response_id(handle.job_id), int(time.time()),
                            await s.models.served_as(p.model) or p.model, asked.echo)
        record = None
        if asked.store:
            stream, entry = s.client.router.entry(handle.job_id) or ("", "")
            record = Record(view.id, handle.job_id, caller.tenant, view.created_at, view.model, asked.echo,
                            asked.conversation, stream, entry, inputs=asked.inputs)
            await self.store.put(record)
            if asked.background and self.outbox is not None and self.outbox.wants(caller.tenant):
                await self.outbox.watch(view.id)  # its end sends response.completed (or .failed, ...)
        headers = {"x-request-id": handle.job_id}
        if p.stream:
            # the events before any token: the message item opens at once, or, with tools, where the text says
            preamble = (2 if p.tools is not None else 4) + asked.background
            events = s.metrics.stream(self.events(view, handle, record, asked.background, p.tools),
                                      request.state.kvgate_route, request.state.kvgate_started, preamble=preamble)
            return StreamingResponse(events, media_type="text/event-stream", headers=sse.HEADERS | headers)
        if asked.background:
            return json_response(view.body("queued"), headers=headers)
        (result,) = await s.wait(request, [handle])
        answer = view.finished(result)
        if record is not None:
            await self.store.finish(record, answer, result.text)
        if (error := failure(result)) is not None:
            raise error
        return json_response(answer, headers=headers)

    async def events(self, view: ResponseView, handle: AsyncJobHandle, record: Record | None,
                     background: bool, tools: Tools | None = None) -> AsyncIterator[bytes]:
        """The typed events of one response. A client that goes away cancels its job, unless it runs in the
        background: only cancel stops that."""
        s, events = self.serving, ResponseEvents(view, tools)
        for event in events.opening("queued" if background else "in_progress"):
            yield frame(event)
        inbox: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(sse.pump(0, handle, s.settings.request_timeout_s, inbox))
        try:
            while True:
                _, item = await inbox.get()
                if isinstance(item, sse.StreamText):
                    for event in events.delta(item.text, item.logprobs, item.parser):
                        yield frame(event)
                    continue
                if isinstance(item, Result):
                    closing = events.closing(item)
                    if record is not None:
                        await self.store.finish(record, closing[-1]["response"], events.text)
                else:  # the job went quiet past the timeout, restarted saying something else, or Redis failed
                    error = item if isinstance(item, ApiError) else from_sdk(item, {}, 1)
                    if background:  # the stream ends, the job runs on (only cancel stops it)
                        error = ApiError(error.status, f"the stream ended: {error.message.split(';')[0]}; the "
                                                       f"background job runs on: GET /v1/responses/{view.id} reads "
                                                       "it", code=error.code)
                    closing = events.detached(error) if background else events.failing(error)
                for event in closing:
                    yield frame(event)
                return
        finally:
            pump.cancel()
            if not handle.done() and not background:
                s.abandon([handle])

    # -- read, cancel, delete ---------------------------------------------------------------------
    async def retrieve(self, request: Request) -> Response:
        caller = self.serving.keys.caller(request)
        for name, value in request.query_params.items():  # stream=true resumes a stream; not kept: refused
            raise unsupported(name, value, " on GET /v1/responses/{id}")
        return json_response(await self.current(await self.found(request.path_params["response_id"], caller)))

    async def input_items(self, request: Request) -> Response:
        """The request's own `input` as items, a cursor page (`limit`, `after`, `order`: desc by default)."""
        caller = self.serving.keys.caller(request)
        query = request.query_params
        for name, value in query.items():
            if name not in ("limit", "after", "order"):
                raise unsupported(name, value, " on GET /v1/responses/{id}/input_items")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order", f"order={order!r} must be asc or desc")
        items = (await self.found(request.path_params["response_id"], caller)).input_items()
        items = items if order == "asc" else items[::-1]
        ids = [item["id"] for item in items]
        start = ids.index(query["after"]) + 1 if query.get("after") in ids else 0
        if "after" in query and start == 0:
            raise invalid("after", f"after={query['after']!r} is not an input item of this response")
        limit = limit_of(request, 20, 100)
        return json_response(page_body(items[start:start + limit], start + limit < len(items)))

    async def cancel(self, request: Request) -> Response:
        caller = self.serving.keys.caller(request)
        record = await self.found(request.path_params["response_id"], caller)
        if not record.echo.get("background"):
            raise invalid("response_id", f"response {record.id} was not created with background=true; only a "
                                         "background response can be cancelled (a client stops its own request by "
                                         "closing it)", code="not_background")
        body = await self.current(record)
        if body["status"] in FINAL and body["status"] != "cancelled":
            raise ApiError(409, f"response {record.id} is {body['status']}; only a queued or in_progress response can "
                                "be cancelled", param="response_id", code="response_not_cancellable")
        if body["status"] != "cancelled":
            try:
                await self.serving.client.cancel(record.job_id)
            except KvgateError as e:
                raise from_sdk(e, {}, self.serving.settings.retry_after_s) from None
            # a queued job is cancelled from now on (the worker that reads it answers so); a running one stops
            # within a step or two: wait for its end, bounded
            deadline = time.monotonic() + CANCEL_WAIT_S
            while (body := await self.current(record))["status"] == "in_progress" and time.monotonic() < deadline:
                await asyncio.sleep(CANCEL_POLL_S)
        return json_response(body)

    async def delete(self, request: Request) -> Response:
        """Forget a stored response; its job, if it still runs, is cancelled: nobody can read its answer now."""
        caller = self.serving.keys.caller(request)
        record = await self.found(request.path_params["response_id"], caller)
        if record.final is None and await self.serving.client.get(record.job_id) is None:
            await self.serving.client.cancel(record.job_id)
        await self.store.delete(record)
        return json_response({"id": record.id, "object": "response", "deleted": True})

    # -- state ------------------------------------------------------------------------------------
    async def ended(self, rid: str) -> tuple[str, str] | None:
        """A watched background response's final status and tenant (`gone` once its record is), None while it runs:
        what the webhook sender asks."""
        job_id = job_of(rid)
        record = None if job_id is None else await self.store.get(rid, job_id)
        if record is None:
            return "gone", ""
        status = (await self.current(record))["status"]
        return (status, record.tenant) if status in FINAL else None

    async def found(self, rid: str, caller: Caller) -> Record:
        """The stored response, if `caller` may see it; another tenant's is answered as one that does not exist."""
        job_id = job_of(rid) if isinstance(rid, str) else None
        record = None if job_id is None else await self.store.get(rid, job_id)
        if record is None or not caller.sees(record.tenant):
            raise ApiError(404, f"no stored response with id {rid!r} (store=false keeps none; a stored one is kept "
                                f"{self.serving.settings.responses_ttl_s} s)", param="response_id",
                           code="response_not_found")
        return record

    async def previous(self, rid: Any, caller: Caller) -> Record:
        """The response previous_response_id continues: stored, the caller's, and answered."""
        try:
            record = await self.found(rid, caller)
        except ApiError as e:
            raise invalid("previous_response_id", e.message, code="previous_response_not_found") from None
        status = (await self.current(record))["status"]
        if status not in CONTINUABLE:
            raise invalid("previous_response_id", f"response {rid} is {status}; only a completed or incomplete "
                                                  "response can be continued")
        return record

    async def current(self, record: Record) -> dict[str, Any]:
        """A stored response as it stands: its final body once its job ended (recorded the first time it is seen),
        else queued or in_progress from the job's state in Redis."""
        if record.final is not None:
            return record.final
        client, view = self.serving.client, ResponseView(record.id, record.created_at, record.model, record.echo)
        result, state = await client.get(record.job_id), None
        if result is None:
            state = await self.state(record)
            if state.state == "finished":  # it ended while we looked
                result = await client.get(record.job_id)
        if result is not None:
            body = view.finished(result)
            await self.store.finish(record, body, result.text)
            return body
        if state.state == "lost":
            body = view.failed(ApiError(500, f"job {record.job_id} is lost: {state.detail}", code="job_lost"))
            await self.store.finish(record, body, None)
            return body
        if state.state == "queued" and await client.redis.exists(client.keys.cancel(record.job_id)):
            return view.body("cancelled")  # the worker that reads it answers it cancelled, never runs it
        return view.body("in_progress" if state.state == "running" else "queued")

    async def state(self, record: Record) -> JobStatus:
        client = self.serving.client
        self._open()
        entry = (record.stream, record.entry) if record.entry else None
        try:
            return await run_async(job_status(client.redis, self._states, client.keys, record.job_id, entry))
        except KvgateError as e:
            raise from_sdk(e, {}, self.serving.settings.retry_after_s) from None

