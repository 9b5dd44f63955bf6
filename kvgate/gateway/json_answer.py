"""The one way every API answers with JSON: a body encoded by msgspec, its status and headers."""
from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")
