"""The JSON body of a request, or a 400 that says why it is not JSON."""
from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from .errors import invalid


async def read_json(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid("body", f"the request body is not JSON: {e}", code="invalid_json") from None
