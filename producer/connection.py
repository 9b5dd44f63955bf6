"""Where the SDK finds Redis, and how it says so when it cannot."""
from __future__ import annotations

import os
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import redis

from .errors import ConnectionFailed, KvgateError

URL_ENV = "KVGATE_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"  # the default of the worker and every `kvgate` command


def resolve_url(redis_url: str | None, default: str | None = None) -> str:
    """The URL given, else $KVGATE_REDIS_URL, else `default`; checked for a scheme. The SDK passes no default:
    a library never guesses which Redis to write jobs into."""
    url = redis_url or os.environ.get(URL_ENV) or default
    if not url:
        raise KvgateError(f"no Redis URL: pass redis_url=..., set {URL_ENV}, or start one with `kvgate redis`")
    return check_url(url)


def check_url(url: str) -> str:
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise KvgateError(f"Redis URL {mask_url(url)!r} must start with redis://, rediss:// or unix:// "
                          f"(for example {DEFAULT_URL})")
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
