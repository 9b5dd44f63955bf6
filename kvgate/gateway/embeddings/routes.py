"""OpenAI's POST /v1/embeddings: one embedding job (task embed) per input, through the queue like any job, answered by
a worker of the model that runs it as a prefill (engine/pooling_params.py); kvgate/openai/embeddings.py holds the
dialect, shared with batch files."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvgate.openai.embeddings import BadEmbeddings, EmbeddingsBody, parse_body, response_body, submit_args

from ..errors import ApiError
from ..json_answer import json_response
from ..request_body import read_json, sized
from ..serving import Serving


def checked_body(body: object, max_token_ids: int) -> EmbeddingsBody:
    try:
        parsed = parse_body(body)
    except BadEmbeddings as e:
        raise ApiError(400, str(e), param=e.param, code=e.code) from None
    _token_id_budget(parsed, max_token_ids)
    return parsed


def _token_id_budget(body: EmbeddingsBody, limit: int) -> None:
    """A request's token ids are bounded as chat's and completions' are: each is checked and encoded on the event
    loop, and the whole request is one admission whose prefill a worker computes."""
    ids = sum(len(x) for x in body.inputs if not isinstance(x, str))
    if ids > limit:
        raise ApiError(400, f"input holds {ids} token ids, over this gateway's limit of {limit} per request "
                            "(--max-prompt-token-ids); send fewer or shorter inputs per request", param="input",
                       code="invalid_value")


class EmbeddingsApi:
    def __init__(self, serving: Serving):
        self.serving = serving

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.embeddings, methods=["POST"])]

    async def embeddings(self, request: Request) -> Response:
        s = self.serving
        tenant = s.keys.caller(request).tenant
        body = await sized(request, checked_body, await read_json(request), s.settings.max_prompt_token_ids)
        await s.models.check(body.model)
        jobs = [{**args, "tenant": tenant, "ttl_s": s.settings.request_timeout_s} for args in submit_args(body)]
        handles = await s.submit(jobs, {"prompt": "input", "prompt_token_ids": "input", "requests": "input"})
        results = await s.answers(request, handles)
        return json_response(response_body(body, results, results[0].model),
                             headers={"x-request-id": handles[0].job_id})
