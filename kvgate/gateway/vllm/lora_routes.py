"""vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}: register
and unregister a LoRA adapter fleet-wide (`{ns}:loras`, producer/loras.py), answered as vLLM answers (plain text).

vLLM's server has one base model; a fleet has several, so the body may name the adapter's `base_model_name`; without
it, the base is the one model the live workers serve, and with several it is a 400 naming them. The path is read by
the workers of that model, never by the gateway. With API keys set, only an admin key may change the registry (an
adapter's path points every worker of its base model at a folder).
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from kvgate.producer import InvalidRequest
from kvgate.producer.keys import DEFAULT_MODEL
from kvgate.producer.loras import add_lora, get_lora, remove_lora
from kvgate.producer.steps import run_async

from ..errors import ApiError, invalid
from ..request_body import read_json, sized
from ..serving import Serving


class LoadLora(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)  # vLLM's load_inplace etc. change nothing
    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]
    base_model_name: str | None = None


class UnloadLora(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)  # vLLM's lora_int_id: the name is enough
    lora_name: Annotated[str, Field(min_length=1)]


class LoraRoutes:
    def __init__(self, serving: Serving):
        self.serving = serving

    def routes(self) -> list[Route]:
        return [Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload, methods=["POST"])]

    def _admin(self, request: Request) -> None:
        caller = self.serving.keys.caller(request)
        if not (self.serving.keys.open or caller.admin):
            raise ApiError(403, "registering or removing a LoRA adapter takes an admin key (--admin-key): an adapter's "
                                "path points the fleet's workers at a folder", code="insufficient_permissions")

    async def load(self, request: Request) -> Response:
        self._admin(request)
        body: LoadLora = await sized(request, _parse, LoadLora, await read_json(request))
        client = self.serving.client
        if (have := await run_async(get_lora(client.redis, client.keys, body.lora_name))) is not None:
            raise invalid("lora_name", f"The lora adapter '{body.lora_name}' has already been loaded (its base is "
                                       f"{have.base!r}, its path {have.path!r}); unload it first")
        base = body.base_model_name or await self._only_base()
        try:
            await run_async(add_lora(client.redis, client.keys, body.lora_name, body.lora_path, base))
        except InvalidRequest as e:
            raise invalid(e.field if e.field != "name" else "lora_name", str(e)) from None
        self.serving.models.forget()
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        self._admin(request)
        body: UnloadLora = await sized(request, _parse, UnloadLora, await read_json(request))
        client = self.serving.client
        if not await run_async(remove_lora(client.redis, client.keys, body.lora_name)):
            raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="lora_not_found")
        self.serving.models.forget()
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def _only_base(self) -> str:
        fleet = await self.serving.models.fleet(fresh=True)
        bases = sorted({c for m in fleet.live.values() for c in m.canonical} - {DEFAULT_MODEL})
        if len(bases) != 1:
            raise invalid("base_model_name", f"the fleet serves {len(bases)} models ({bases}): name the adapter's base "
                                             "model in base_model_name")
        return bases[0]


def _parse(kind: type[BaseModel], body: object) -> BaseModel:
    """A body as `kind`, or the 400 naming its first bad field."""
    if not isinstance(body, dict):
        raise invalid("body", f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or "body"
        raise invalid(param, f"{param}: {err['msg']}") from None
