"""The Redis and keys of the namespace a command works on, for commands that look at or change it in one go."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from kvgate.producer.connection import DEFAULT_URL, resolve_url, translated
from kvgate.producer.keys import Keys
from kvgate.producer.redis_url import connect, keys_for


@contextlib.contextmanager
def namespace_redis(redis_url: str | None, namespace: str) -> Iterator[tuple[Any, Keys]]:
    """A client of `redis_url` (the flag; else KVGATE_REDIS_URL, else the default) and `namespace`'s keys (on a cluster,
    its shards), closed on the way out; Redis errors inside become the commands' one-line messages (translated)."""
    url = resolve_url(redis_url, DEFAULT_URL)
    with translated(url):
        r = connect(url)
        try:
            yield r, keys_for(url, r, namespace)
        finally:
            r.close()
