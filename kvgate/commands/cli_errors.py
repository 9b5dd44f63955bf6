"""How the `kvgate` command says what went wrong: one line, naming the Redis URL where Redis was the problem."""
from __future__ import annotations

import redis

from kvgate.producer.connection import mask_url
from kvgate.producer.errors import ConnectionFailed, KvgateError

EXIT_BAD_INPUT, EXIT_FAILED = 2, 1


def describe(error: BaseException, url: str | None) -> str:
    where = f"Redis at {mask_url(url)}" if url else "Redis"
    if isinstance(error, ConnectionFailed):
        text = str(error)
    elif isinstance(error, (redis.ConnectionError, redis.TimeoutError)):  # AuthenticationError included
        text = f"cannot reach {where}: {error}; check that it runs (`kvgate redis` starts one) and the URL"
    elif isinstance(error, redis.exceptions.NoPermissionError):
        text = (f"{where} refused a command to this user: {error}; grant it in the user's ACL "
                "(deploy/redis/acl.conf has the roles) or use a user that has it")
    elif isinstance(error, redis.ResponseError) and "DB index" in str(error):
        text = f"{where}: {error}; the server has fewer databases: use an index it has (/0 is the default)"
    elif isinstance(error, redis.RedisError):
        text = f"{where} answered with an error: {error}"
    elif isinstance(error, (KvgateError, ValueError, OSError)):
        text = str(error)
    else:
        text = f"{type(error).__name__}: {error}"
    return " ".join(text.split()) + " (--debug shows the traceback)"


def exit_code(error: BaseException) -> int:
    bad_input = isinstance(error, (ValueError, KvgateError)) and not isinstance(error, ConnectionFailed)
    return EXIT_BAD_INPUT if bad_input else EXIT_FAILED
