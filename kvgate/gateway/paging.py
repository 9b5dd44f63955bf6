"""OpenAI's cursor pages (`?limit=N&after=<last id of the previous page>`, answered as a list object)."""
from __future__ import annotations

from typing import Any

from starlette.requests import Request

from .errors import invalid


def limit_of(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise invalid("limit", f"limit={raw!r} must be a whole number from 1 to {most}")
    return limit


def page_body(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}

