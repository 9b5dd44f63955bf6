"""vLLM's extras: GET /version, and POST /tokenize and /detokenize, answered by a serving worker's own tokenizer
through the queue.

The gateway has no tokenizer, and a copy would have to equal the worker's exactly (its files, its chat template, its
`encode_chat`). So each request is a job of its own kind (Job.task, worker/tokenizer_jobs.py): enqueued at high
priority with a deadline of the request timeout, answered by the first worker of the model that reads it, at once,
without the engine or a KV block. The price: it waits while every worker of the model is too full to read a job.
"""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvgate import __version__
from kvgate.producer import Result

from ..json_answer import json_response
from ..request_body import read_json, sized
from ..serving import Serving
from .bodies import Detokenize, TokenizeChat, TokenizePrompt, parse, tokenize_body


class VllmApi:
    def __init__(self, serving: Serving):
        self.serving = serving

    def routes(self) -> list[Route]:
        return [Route("/version", self.version, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"])]

    async def version(self, request: Request) -> Response:
        """Open, as /health is."""
        return json_response({"version": __version__})

    async def tokenize(self, request: Request) -> Response:
        tenant = self.serving.keys.caller(request).tenant
        req: TokenizePrompt | TokenizeChat = await sized(request, tokenize_body, await read_json(request))
        text = {"prompt": req.prompt} if isinstance(req, TokenizePrompt) else \
            {"messages": [m.model_dump() for m in req.messages]}
        result = await self._ask(request, req.model, tenant, {**text, "task": "tokenize",
                                                              "add_special_tokens": req.add_special_tokens})
        return json_response({"count": len(result.token_ids), "max_model_len": result.max_model_len,
                              "tokens": result.token_ids, "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        tenant = self.serving.keys.caller(request).tenant
        req: Detokenize = await sized(request, parse, Detokenize, await read_json(request))
        result = await self._ask(request, req.model, tenant, {"prompt_token_ids": list(req.tokens),
                                                              "task": "detokenize"})
        return json_response({"prompt": result.text})

    async def _ask(self, request: Request, model: str, tenant: str, spec: dict[str, Any]) -> Result:
        """One tokenizer job of `model` for the caller's tenant, and its result; an error result is the HTTP error
        a generation job's would be (the worker's refusal of the input: 400)."""
        s = self.serving
        await s.models.check(model)
        spec |= {"model": model, "tenant": tenant, "priority": "high", "max_tokens": 1,
                 "ttl_s": s.settings.request_timeout_s}
        handles = await s.submit([spec], {"prompt_token_ids": "tokens"})
        (result,) = await s.answers(request, handles)
        return result
