"""vLLM's POST /tokenize and /detokenize, answered by a serving worker's own tokenizer through the queue.

The gateway has no tokenizer, and a copy would have to equal the worker's exactly (its files, its chat template, its
`encode_chat`). So each request is a job of its own kind (Job.task, worker/tokenizer_jobs.py): enqueued at high
priority with a deadline of the request timeout, answered by the first worker of the model that reads it, at once,
without the engine or a KV block. The price: it waits while every worker of the model is too full to read a job.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvgate.producer import KvgateError, Result
from kvgate.producer.keys import DEFAULT_MODEL
from kvgate.producer.limits import MAX_MESSAGES, MAX_PROMPT_CHARS
from kvgate.producer.request import MAX_TOKEN_ID, ChatMessage

from .errors import from_sdk, invalid, unsupported
from .request_body import read_json, sized
from .responses import failure

if TYPE_CHECKING:
    from .app import Gateway

# vLLM fields the worker's tokenizer answer cannot honour (it encodes messages exactly as a generation job's):
# refused by name instead of ignored; their value that matches what the worker does is accepted
CHAT_AS_GENERATED = {"add_generation_prompt": True, "add_special_tokens": False, "continue_final_message": False}
NOT_HONOURED = ("chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    model: Annotated[str, Field(min_length=1)] = DEFAULT_MODEL  # vLLM's is optional: the model the fleet serves
    return_token_strs: bool | None = False


class TokenizePrompt(_Body):
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
    add_special_tokens: bool = True


class TokenizeChat(_Body):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    continue_final_message: bool = False


class Detokenize(_Body):
    tokens: Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]],
                      Field(min_length=1, max_length=MAX_PROMPT_CHARS)]


def parse(kind: type[BaseModel], body: Any) -> BaseModel:
    """A body as `kind`, or the 400 that names its first bad field and value."""
    if not isinstance(body, dict):
        raise invalid("body", f"the request body must be a JSON object, got {type(body).__name__}")
    for name in NOT_HONOURED if kind is not Detokenize else ():
        if body.get(name) is not None:
            raise unsupported(name, body[name], " for /tokenize: the worker applies the model's own chat template")
    try:
        parsed = kind.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or "body"
        shown = repr(err.get("input"))
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise invalid(param, f"{param}: {err['msg']} (got {shown})", code="invalid_value") from None
    if parsed.return_token_strs:
        raise unsupported("return_token_strs", True, " (the tokens' strings are not returned)")
    if isinstance(parsed, TokenizeChat):
        for name, honoured in CHAT_AS_GENERATED.items():
            if getattr(parsed, name) != honoured:
                raise unsupported(name, getattr(parsed, name), f" with messages: the worker tokenizes them as a chat "
                                                               f"request's, {name}={honoured}")
    return parsed


def tokenize_body(body: Any) -> TokenizePrompt | TokenizeChat:
    """vLLM's two tokenize bodies: `prompt` or `messages`."""
    has_messages = isinstance(body, dict) and "messages" in body
    return parse(TokenizeChat if has_messages else TokenizePrompt, body)


class TokenizerApi:
    """The two routes; the gateway's client, models and keys are read when a request comes (they exist from the
    gateway's start on)."""

    def __init__(self, gateway: "Gateway"):
        self.gw = gateway

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"])]

    async def tokenize(self, request: Request) -> Response:
        tenant = self.gw.keys.caller(request).tenant
        req: TokenizePrompt | TokenizeChat = await sized(request, tokenize_body, await read_json(request))
        text = {"prompt": req.prompt} if isinstance(req, TokenizePrompt) else \
            {"messages": [m.model_dump() for m in req.messages]}
        result = await self._ask(request, req.model, tenant, {**text, "task": "tokenize",
                                                              "add_special_tokens": req.add_special_tokens})
        return _json({"count": len(result.token_ids), "max_model_len": result.max_model_len,
                      "tokens": result.token_ids, "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        tenant = self.gw.keys.caller(request).tenant
        req: Detokenize = await sized(request, parse, Detokenize, await read_json(request))
        result = await self._ask(request, req.model, tenant, {"prompt_token_ids": list(req.tokens),
                                                              "task": "detokenize"})
        return _json({"prompt": result.text})

    async def _ask(self, request: Request, model: str, tenant: str, spec: dict[str, Any]) -> Result:
        """One tokenizer job of `model` for the caller's tenant, and its result; an error result is the HTTP error
        a generation job's would be (the worker's refusal of the input: 400)."""
        gw = self.gw
        await gw.models.check(model)
        spec |= {"model": model, "tenant": tenant, "priority": "high", "max_tokens": 1,
                 "ttl_s": gw.settings.request_timeout_s}
        try:
            handles = await gw.client.submit_many([spec], progress=False)
        except KvgateError as e:
            raise from_sdk(e, {"prompt_token_ids": "tokens"}, gw.settings.retry_after_s) from None
        (result,) = await gw.wait(request, handles)
        if (error := failure(result)) is not None:
            raise error
        return result


def _json(body: dict[str, Any]) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")

