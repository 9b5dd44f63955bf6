"""OpenAI's POST /v1/chat/completions and /v1/completions: a body planned into jobs (plan.py), submitted in one
admission, answered whole (bodies.py) or as server-sent events (sse.py)."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvgate.producer import AsyncJobHandle

from ..auth import Caller
from ..json_answer import json_response
from ..request_body import read_json, sized
from ..serving import Serving
from . import sse
from .bodies import Reply
from .plan import Kind, Plan, plan


async def submit_plan(serving: Serving, p: Plan, caller: Caller) -> list[AsyncJobHandle]:
    """Enqueue the plan's jobs as the caller's tenant's: all its jobs (choices, prompts) or none. An error about all
    its jobs names what made them many: prompts, or choices."""
    many = {"requests": "prompt" if len(set(p.prompt_of)) > 1 else "n"}
    return await serving.submit([{**s, "tenant": caller.tenant} for s in p.submits], many | p.names)


class ChatApi:
    def __init__(self, serving: Serving):
        self.serving = serving

    def routes(self) -> list[Route]:
        return [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"])]

    async def chat(self, request: Request) -> Response:
        return await self.complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, "completion")

    async def complete(self, request: Request, kind: Kind) -> Response:
        s = self.serving
        caller = s.keys.caller(request)
        p = await sized(request, plan, kind, await read_json(request), s.settings)  # big body: checked off the loop
        await s.models.check(p.model)
        if p.fill_in_middle:
            await s.models.check_fim(p.model)
        handles = await submit_plan(s, p, caller)
        reply = Reply(p, f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{handles[0].job_id}",
                      served=await s.models.served_as(p.model))
        headers = {"x-request-id": handles[0].job_id}
        if p.stream:
            events = sse.events(reply, handles, s.settings.request_timeout_s, s.abandon)
            events = s.metrics.stream(events, request.state.kvgate_route, request.state.kvgate_started,
                                      preamble=len(handles) if kind == "chat" else 0)
            return StreamingResponse(events, media_type="text/event-stream", headers=sse.HEADERS | headers)
        return json_response(reply.body(await s.answers(request, handles)), headers=headers)
