"""OpenAI's file expiry policy, `{"anchor": "created_at", "seconds": N}`: `expires_after` on an upload (/v1/files) and
`output_expires_after` on a batch (its output and error files). A file past its expires_at, on the Redis server's
clock (invariant 9), is gone: not listed, not read, deleted when next looked at."""
from __future__ import annotations

from typing import Any

from ..errors import invalid

MIN_S, MAX_S = 3600, 30 * 86_400  # OpenAI's range: an hour to 30 days


def expiry_seconds(value: Any, param: str, min_s: int = MIN_S) -> int | None:
    """The policy's seconds (None: no policy given), or a 400 naming `param`, the value and the range (`min_s`: a
    test's shorter least)."""
    if value is None:
        return None
    seconds = value.get("seconds") if isinstance(value, dict) else None
    if isinstance(seconds, str) and seconds.isdigit():  # a multipart form's fields are text
        seconds = int(seconds)
    if (not isinstance(value, dict) or set(value) != {"anchor", "seconds"} or value["anchor"] != "created_at"
            or isinstance(seconds, bool) or not isinstance(seconds, int) or not min_s <= seconds <= MAX_S):
        raise invalid(param, f"{param}={value!r} must be {{\"anchor\": \"created_at\", \"seconds\": N}} with N a whole "
                             f"number from {min_s} to {MAX_S} (30 days)")
    return seconds


def expired(expires_at: int | None, now: int) -> bool:
    return expires_at is not None and now >= expires_at
