"""Bearer API keys: `Authorization: Bearer <key>` must name one of the configured keys; none configured = open."""
from __future__ import annotations

import hmac

from starlette.requests import Request

from .errors import ApiError


def authorize(request: Request, keys: list[str]) -> None:
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "missing API key: send it as `Authorization: Bearer <key>`", code="invalid_api_key")
    token = token.strip().encode()
    # compare with every key, always, so the time taken does not tell which prefix matched
    if not any([hmac.compare_digest(token, k.encode()) for k in keys]):
        raise ApiError(401, f"invalid API key {_masked(token.decode(errors='replace'))}; check the key the gateway "
                            "was started with (--api-key or KVGATE_API_KEYS)", code="invalid_api_key")


def _masked(key: str) -> str:
    return "'" + (key[:3] + "..." + key[-2:] if len(key) > 8 else "***") + "'"
