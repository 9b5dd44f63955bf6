"""The JSON body of a request, or a 400 that says why it is not JSON we take."""
from __future__ import annotations

from typing import Any

from starlette.requests import Request

from kvgate.openai.json_body import BadJson, parse_json

from .errors import invalid


async def read_json(request: Request) -> Any:
    try:
        return parse_json(await request.body())
    except BadJson as e:
        raise invalid("body", f"the request body is not JSON: {e}", code="invalid_json") from None
