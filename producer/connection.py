"""Where the SDK finds Redis, and how it says so when it cannot."""
from __future__ import annotations

import os
from contextlib import contextmanager

import redis

from . import urls
from .errors import ConnectionFailed, KvgateError, NotReplicatedError, ServerRefused
from .urls import DEFAULT_URL, URL_ENV, mask_url  # noqa: F401 - re-exported for the SDK's commands
from .redis_url import NotReplicated

OUT_OF_MEMORY = ("it is out of memory (used memory over maxmemory, with maxmemory-policy noeviction)",
                 "Let the workers drain results, shorten their result TTL or raise maxmemory, then retry")
READ_ONLY = ("it is a read-only replica (a failover moved the primary)",
             "Point the client at the new primary (a Sentinel- or cluster-aware URL does it), then retry")


def resolve_url(redis_url: str | None, default: str | None = None) -> str:
    """The URL given, else $KVGATE_REDIS_URL, else `default`; checked for a scheme. The SDK passes no default:
    a library never guesses which Redis to write jobs into."""
    url = redis_url or os.environ.get(URL_ENV) or default
    if not url:
        raise KvgateError(f"no Redis URL: pass redis_url=..., set {URL_ENV}, or start one with `kvgate redis`")
    return check_url(url)


def check_url(url: str) -> str:
    try:
        return urls.check_url(url)
    except ValueError as e:
        raise KvgateError(str(e)) from None


@contextmanager
def translated(url: str):
    """Turn redis-py's connection errors into ConnectionFailed naming the (masked) URL."""
    try:
        yield
    except NotReplicated as e:
        raise NotReplicatedError(mask_url(url), e) from e
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
