"""Where the SDK finds Redis, and how it says so when it cannot."""
from __future__ import annotations

import os
from contextlib import contextmanager

import redis

from . import protocol
from .errors import ConnectionFailed, KvgateError
from .protocol import DEFAULT_URL, URL_ENV, mask_url  # noqa: F401 - re-exported for the SDK's commands


def resolve_url(redis_url: str | None, default: str | None = None) -> str:
    """The URL given, else $KVGATE_REDIS_URL, else `default`; checked for a scheme. The SDK passes no default:
    a library never guesses which Redis to write jobs into."""
    url = redis_url or os.environ.get(URL_ENV) or default
    if not url:
        raise KvgateError(f"no Redis URL: pass redis_url=..., set {URL_ENV}, or start one with `kvgate redis`")
    return check_url(url)


def check_url(url: str) -> str:
    try:
        return protocol.check_url(url)
    except ValueError as e:
        raise KvgateError(str(e)) from None


@contextmanager
def translated(url: str):
    """Turn redis-py's connection errors into ConnectionFailed naming the (masked) URL."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:  # AuthenticationError is a ConnectionError
        raise ConnectionFailed(mask_url(url), e) from e
