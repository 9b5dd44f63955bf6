"""Every component's Redis client, built from one URL: redis://, rediss://, unix:// as redis-py reads them, a
Redis Cluster URL (redis+cluster://, producer/cluster.py), or a Sentinel URL that follows the primary across a
failover.

    redis+sentinel://[user:password@]host1:26379,host2:26379/<service>[/<db>][?sentinel_username=..&sentinel_password=..]

The user and password in the authority belong to the data nodes (primary and replicas); the sentinels' own
credentials, when they have any, go in the query, so the two never get mixed up. `rediss+sentinel://` speaks TLS
to both. The worker may import this module (it needs nothing from the SDK but protocol), see tests/test_layering.py.

A Sentinel-managed client asks the sentinels for the primary on each new connection, and turns a READONLY reply
(its primary was demoted) into a ConnectionError after dropping the connection: so a retry of an idempotent
command lands on the new primary. `submission.across_failover` is that retry, bounded in time.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel, SentinelConnectionPool
from redis.sentinel import MasterNotFoundError, Sentinel

from .cluster import agreed_shards, connect_cluster, connect_cluster_async, is_cluster, parse_cluster_url, shard_count
from .keys import Keys
from .steps import run_async
from .urls import host_port, mask_url, split_url

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379
SENTINEL_QUERY = ("sentinel_username", "sentinel_password")
# MasterNotFound included; ClusterError: a cluster with a slot uncovered while a replica takes over
FAILOVER_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, redis.exceptions.ClusterError)
FAILOVER_BUDGET_S = 30.0  # Sentinel's default failover takes down-after (30 s in its sample config) plus an election


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """A parsed redis+sentinel:// URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False

    def node_kwargs(self) -> dict:
        kw = {"db": self.db, "username": self.username, "password": self.password}
        return {**kw, "ssl": True} if self.ssl else kw

    def sentinel_kwargs(self, socket_kwargs: dict) -> dict:
        kw = {k: v for k, v in socket_kwargs.items() if k.startswith("socket_")}
        kw |= {"username": self.sentinel_username, "password": self.sentinel_password}
        return {**kw, "ssl": True} if self.ssl else kw


def is_sentinel(url: str) -> bool:
    return split_url(url).scheme in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Raises ValueError naming what is wrong (and never the password)."""
    parts = split_url(url)
    shown = mask_url(url)
    username, _, password = parts.userinfo.partition(":")
    sentinels = tuple(_host_port(h, shown) for h in parts.hosts)
    if not sentinels:
        raise ValueError(f"Sentinel URL {shown!r} names no sentinel: write host1:26379,host2:26379 after //")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError(f"Sentinel URL {shown!r} needs the monitored service name and optionally a db: "
                         "redis+sentinel://host:26379/mymaster/0")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"Sentinel URL {shown!r}: db {path[1]!r} must be a number")
    query = parse_qs(parts.query)
    unknown = sorted(set(query) - set(SENTINEL_QUERY))
    if unknown:
        raise ValueError(f"Sentinel URL {shown!r}: unknown option {unknown[0]!r}; allowed: {', '.join(SENTINEL_QUERY)}")
    option = {k: query[k][-1] for k in SENTINEL_QUERY if k in query}
    return SentinelUrl(sentinels, unquote(path[0]), int(path[1]) if len(path) == 2 else 0,
                       unquote(username) or None, unquote(password) or None,
                       option.get("sentinel_username"), option.get("sentinel_password"),
                       parts.scheme == "rediss+sentinel")


def _host_port(text: str, shown: str) -> tuple[str, int]:
    if (hp := host_port(text, SENTINEL_PORT)) is None:
        raise ValueError(f"Sentinel URL {shown!r}: {text!r} is not host:port")
    return hp


def newest_master(answers: list, service: str, check) -> tuple[str, int]:
    """Of every sentinel's view (or the error it gave), the primary named with the newest config epoch. Right
    after a failover a sentinel that has not heard of it yet still names the old primary; if that one has been
    restarted it is up, a primary with its old data, and accepts writes that its demotion will wipe. The first
    answer (redis-py's rule) can be that stale one; the newest epoch is the failover's."""
    best, errors = None, []
    for answer in answers:
        if isinstance(answer, Exception):
            errors.append(repr(answer))
            continue
        state = answer.get(service)
        if state and check(state, service) and (best is None or state["config-epoch"] > best["config-epoch"]):
            best = state
    if best is None:
        raise MasterNotFoundError(f"no sentinel names a live primary for {service!r}"
                                  + (f": {', '.join(errors)}" if errors else ""))
    return best["ip"], best["port"]


class NewestSentinel(Sentinel):
    def discover_master(self, service_name):
        answers = []
        for sentinel in self.sentinels:
            try:
                answers.append(sentinel.sentinel_masters())
            except (redis.ConnectionError, redis.TimeoutError) as e:
                answers.append(e)
        return newest_master(answers, service_name, self.check_master_state)


class NewestAsyncSentinel(AsyncSentinel):
    async def discover_master(self, service_name):
        answers = []
        for sentinel in self.sentinels:
            try:
                answers.append(await sentinel.sentinel_masters())
            except (redis.ConnectionError, redis.TimeoutError) as e:
                answers.append(e)
        return newest_master(answers, service_name, self.check_master_state)


def connect(url: str, **kwargs) -> redis.Redis:
    """A client for `url`; kwargs (socket timeouts, retry, ...) go to the data-node connections, and the socket
    timeouts also to the sentinel connections."""
    return _connect(url, kwargs, connect_cluster, redis.Redis, NewestSentinel)


def connect_async(url: str, *, pool_size: int | None = None, pool_timeout_s: float | None = None,
                  **kwargs) -> aioredis.Redis:
    """`connect` on redis.asyncio. With `pool_size`, the client holds at most that many connections and a command
    that finds them all in use waits for one (up to `pool_timeout_s`; None: as long as it takes) instead of failing
    with MaxConnectionsError, which redis.asyncio's own pool raises at 100. A Cluster client cannot wait (redis.asyncio's
    cluster client raises at its per-node bound): there `pool_size` is each node's bound."""
    if pool_size is None:
        return _connect(url, kwargs, connect_cluster_async, aioredis.Redis, NewestAsyncSentinel)
    if is_cluster(url):
        return connect_cluster_async(url, max_connections=pool_size, **kwargs)
    pool = {"max_connections": pool_size, "timeout": pool_timeout_s}
    if is_sentinel(url):
        s = parse_sentinel_url(url)
        sentinel = NewestAsyncSentinel(list(s.sentinels), sentinel_kwargs=s.sentinel_kwargs(kwargs))
        return sentinel.master_for(s.service, connection_pool_class=BlockingSentinelPool,
                                   **(s.node_kwargs() | kwargs | pool))
    client = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, **(kwargs | pool)))
    client.auto_close_connection_pool = True  # as Redis.from_url: closing the client closes its pool
    return client


class BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool (connections to whichever node the sentinels name primary) with the blocking pool's wait
    for a free connection."""


def _connect(url: str, kwargs: dict, cluster, plain, sentinel_type):
    if is_cluster(url):
        return cluster(url, **kwargs)
    if not is_sentinel(url):
        return plain.from_url(url, **kwargs)
    s = parse_sentinel_url(url)
    sentinel = sentinel_type(list(s.sentinels), sentinel_kwargs=s.sentinel_kwargs(kwargs))
    return sentinel.master_for(s.service, **(s.node_kwargs() | kwargs))


def keys_for(url: str, client, namespace: str) -> Keys:
    """The namespace's key names on the Redis `client` talks to: on a cluster, split into its recorded shards."""
    if not is_cluster(url):
        return Keys(namespace)
    return Keys(namespace, agreed_shards(client, namespace, parse_cluster_url(url).shards), cluster=True)


async def keys_for_async(url: str, client, namespace: str) -> Keys:
    """keys_for on a redis.asyncio client."""
    if not is_cluster(url):
        return Keys(namespace)
    return Keys(namespace, await run_async(shard_count(client, namespace, parse_cluster_url(url).shards)), cluster=True)


# ---- durability: how many copies a write needs before it counts ------------------------------------------------
DURABILITIES = ("primary", "replicated")


class NotReplicated(redis.ConnectionError):
    """WAIT saw fewer replicas than asked within its timeout. The primary holds writes a failover could drop, which
    is as unsafe as a lost reply: callers send the same idempotent writes again instead of counting them done.
    A ConnectionError, so every retry-on-outage path (the worker's backoff, submission.across_failover) treats it as one."""

    def __init__(self, acked: int, wanted: int, timeout_ms: int):
        super().__init__(f"WAIT {wanted} {timeout_ms}: {acked} of {wanted} replicas acknowledged within {timeout_ms} "
                         "ms; the writes are on the primary only, so they are sent again (is a replica connected?)")


@dataclass(frozen=True, slots=True)
class Durability:
    """'primary': a write counts once the primary answered (Redis's default; a failover may drop the last writes).
    'replicated': it counts once `replicas` replicas have it too (WAIT, on the connection that wrote it)."""

    mode: str = "primary"
    replicas: int = 1
    timeout_ms: int = 1000

    def __post_init__(self):
        if self.mode not in DURABILITIES:
            raise ValueError(f"durability={self.mode!r}: allowed values: {', '.join(DURABILITIES)}")
        if self.replicas < 1 or self.timeout_ms < 1:
            raise ValueError(f"durability needs replicas >= 1 and timeout_ms >= 1, got {self.replicas} and "
                             f"{self.timeout_ms}")

    @property
    def replicated(self) -> bool:
        return self.mode == "replicated"

    def wait(self, pipe) -> None:
        """Queue WAIT after the writes on `pipe` (a plain pipeline: inside MULTI, WAIT does not block)."""
        pipe.execute_command("WAIT", self.replicas, self.timeout_ms)

    def check(self, reply) -> None:
        """Raise unless the WAIT reply says enough replicas have every earlier write of that connection."""
        if isinstance(reply, Exception):
            raise reply
        if int(reply) < self.replicas:
            raise NotReplicated(int(reply), self.replicas, self.timeout_ms)
