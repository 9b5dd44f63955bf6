"""Where the SDK finds Redis, and how it says so when it cannot."""
from __future__ import annotations

import os
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import redis

from .errors import ConnectionFailed, KvgateError, ServerRefused

OUT_OF_MEMORY = ("it is out of memory (used memory over maxmemory, with maxmemory-policy noeviction)",
                 "Let the workers drain results, shorten their result TTL or raise maxmemory, then retry")
READ_ONLY = ("it is a read-only replica (a failover moved the primary)",
             "Point the client at the new primary (a Sentinel- or cluster-aware URL does it), then retry")

URL_ENV = "KVGATE_REDIS_URL"


def resolve_url(redis_url: str | None) -> str:
    url = redis_url or os.environ.get(URL_ENV)
    if not url:
        raise KvgateError(f"no Redis URL: pass redis_url=..., set {URL_ENV}, or start one with `kvgate redis`")
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise KvgateError(f"Redis URL {mask_url(url)!r} must start with redis://, rediss:// or unix://")
    return url


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, fit for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = f":{parts.port}" if parts.port else ""
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


@contextmanager
def translated(url: str):
    """Turn redis-py's connection errors into ConnectionFailed naming the (masked) URL."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:  # AuthenticationError is a ConnectionError
        raise ConnectionFailed(mask_url(url), e) from e
    except redis.ResponseError as e:  # redis-py's message quotes the command, payload bytes and all: not shown
        refusal = refusal_of(e)
        if refusal is None:
            raise
        raise ServerRefused(mask_url(url), *refusal) from None


def refusal_of(e: Exception) -> tuple[str, str] | None:
    """OOM or READONLY, also when a script (Redis 6.2 wraps its errors) or a transaction carried it."""
    text = str(e)
    if isinstance(e, redis.exceptions.OutOfMemoryError) or "OOM command not allowed" in text:
        return OUT_OF_MEMORY
    if isinstance(e, redis.exceptions.ReadOnlyError) or "READONLY You can't write" in text:
        return READ_ONLY
    return None
