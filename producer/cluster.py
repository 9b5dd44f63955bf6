"""Redis Cluster: the URL, the client, and Lua scripts in cluster pipelines.

    redis+cluster://[user:password@]host1:6379,host2:6379[/?shards=N]

Any reachable nodes will do; the client learns the rest (and follows failovers and slot moves) from CLUSTER
SLOTS. `shards` is how many hash-tagged shards a namespace is split into (producer/shards.py); the first process to
use a namespace records it at `{ns}:shards`, and every later one follows that record, whatever its own URL says:
two processes that disagreed would write jobs where the other never reads. `rediss+cluster://` speaks TLS.

redis-py's cluster pipeline refuses `Script.__call__`; `run_script` sends the EVALSHA itself (routed by its keys,
which must share a slot), after loading the script on every primary once. A primary that never saw it (a promoted
replica whose cache is empty, a new primary after a reshard) answers NOSCRIPT: `scripts_lost` makes the next call
load again, so the caller's retry goes through: every script this process loaded that way, since any of them may
be the next to meet the new primary (the lane ring's, which every worker runs on every beat since issue 45.8, stalled
a worker without affinity for good after a failover when only the read and finish scripts were marked).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.crc import key_slot

from .shards import check_shards
from .steps import Steps, call, returning, run
from .urls import host_port, mask_url, split_url

log = logging.getLogger(__name__)

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379
FAILOVER_RETRIES, FAILOVER_BACKOFF_CAP_S = 20, 0.5  # about 9 s of retrying: a replica's promotion takes a few
SHARDS_PER_PRIMARY = 2  # the default when a namespace is first used: room to add primaries without resharding keys


@dataclass(frozen=True, slots=True)
class ClusterUrl:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    shards: int | None = None  # None: SHARDS_PER_PRIMARY per primary, unless the namespace has a record


def is_cluster(url: str) -> bool:
    return split_url(url).scheme in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterUrl:
    """Raises ValueError naming what is wrong (and never the password)."""
    parts, shown = split_url(url), mask_url(url)
    username, _, password = parts.userinfo.partition(":")
    nodes = tuple(_host_port(h, shown) for h in parts.hosts)
    if not nodes:
        raise ValueError(f"cluster URL {shown!r} names no node: write host1:6379,host2:6379 after //")
    if parts.path.strip("/"):
        raise ValueError(f"cluster URL {shown!r}: a cluster has only db 0, so the URL takes no path "
                         f"({parts.path!r}); write redis+cluster://host:6379/")
    query = parse_qs(parts.query)
    unknown = sorted(set(query) - {"shards"})
    if unknown:
        raise ValueError(f"cluster URL {shown!r}: unknown option {unknown[0]!r}; allowed: shards")
    shards = None
    if "shards" in query:
        text = query["shards"][-1]
        if not text.isdigit():
            raise ValueError(f"cluster URL {shown!r}: shards={text!r} must be a whole number")
        shards = check_shards(int(text))
    return ClusterUrl(nodes, unquote(username) or None, unquote(password) or None, parts.scheme == "rediss+cluster",
                      shards)


def _host_port(text: str, shown: str) -> tuple[str, int]:
    if (hp := host_port(text, DEFAULT_PORT)) is None:
        raise ValueError(f"cluster URL {shown!r}: {text!r} is not host:port")
    return hp


def _kwargs(c: ClusterUrl, kwargs: dict, retry_class=None) -> dict:
    """The caller's connection options, with the cluster's own retry: a refused or dropped connection (a primary
    died) makes the client read the slots again and retry, with backoff, long enough for the replica's promotion
    (the node timeout plus an election: a few seconds)."""
    kw = {k: v for k, v in kwargs.items() if k != "retry"}
    kw |= {"username": c.username, "password": c.password,
           "retry": (retry_class or Retry)(ExponentialBackoff(cap=FAILOVER_BACKOFF_CAP_S, base=0.05), FAILOVER_RETRIES)}
    return {**kw, "ssl": True} if c.ssl else kw


def connect_cluster(url: str, **kwargs) -> RedisCluster:
    c = parse_cluster_url(url)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in c.nodes], **_kwargs(c, kwargs))


def connect_cluster_async(url: str, **kwargs):
    from redis.asyncio.cluster import ClusterNode as AsyncNode, RedisCluster as AsyncCluster
    from redis.asyncio.retry import Retry as AsyncRetry

    c = parse_cluster_url(url)
    return AsyncCluster(startup_nodes=[AsyncNode(h, p) for h, p in c.nodes], **_kwargs(c, kwargs, AsyncRetry))


def is_cluster_client(client) -> bool:
    from redis.asyncio.cluster import ClusterPipeline as AsyncPipeline, RedisCluster as AsyncCluster

    return isinstance(client, (RedisCluster, AsyncCluster, AsyncPipeline))


# ---- scripts ----------------------------------------------------------------------------------------------------
def run_script(script, keys: list, args: list, client):
    """`script(keys=, args=, client=)`, also on a cluster pipeline (where redis-py refuses it). On an asyncio
    pipeline the caller awaits what this returns, as it would a script call."""
    from redis.asyncio.cluster import ClusterPipeline as AsyncPipeline

    if isinstance(client, AsyncPipeline):
        return _queue_async(script, keys, args, client)
    if not isinstance(client, ClusterPipeline):
        return script(keys=keys, args=args, client=client)
    if not getattr(script, "_kvgate_loaded", False):
        script.registered_client.script_load(script.script)  # SCRIPT LOAD goes to every primary
        script._kvgate_loaded = True
        _LOADED.add(script)
    # the node named: else redis-py 8 asks its default node COMMAND GETKEYS for every EVALSHA in a pipeline, an
    # extra round trip per job on one node of the whole fleet (W-FLEET's hot primary)
    node = client.nodes_manager.get_node_from_slot(key_slot(keys[0].encode()))
    return client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, target_nodes=node)


async def _queue_async(script, keys: list, args: list, pipe) -> None:
    if not getattr(script, "_kvgate_loaded", False):
        await script.registered_client.script_load(script.script)
        script._kvgate_loaded = True
        _LOADED.add(script)
    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


def get_many(client, names: list[str]):
    """MGET that a cluster splits by slot (on an asyncio client, a coroutine)."""
    return client.mget_nonatomic(names) if is_cluster_client(client) else client.mget(names)


_LOADED: "weakref.WeakSet" = weakref.WeakSet()  # the scripts run_script loaded onto the primaries


def scripts_lost() -> None:
    """After NOSCRIPT: load every script again before its next call."""
    for script in list(_LOADED):
        script._kvgate_loaded = False


def is_noscript(error: BaseException) -> bool:
    return isinstance(error, redis.exceptions.NoScriptError) or "NOSCRIPT" in str(error)


# ---- the namespace's shard count --------------------------------------------------------------------------------
def shards_key(namespace: str) -> str:
    return f"{namespace}:shards"


def shard_count(client, namespace: str, wanted: int | None) -> Steps:
    """The namespace's recorded shard count; the first caller records `wanted` (or the default)."""
    recorded = yield call(client.get, shards_key(namespace))  # read first: a read-only user (monitor, KEDA) may not
    if recorded is None:                                        # record it
        count = wanted or SHARDS_PER_PRIMARY * max(1, len(client.get_primaries()))
        yield call(client.set, shards_key(namespace), count, nx=True)
        recorded = yield call(client.get, shards_key(namespace))
    recorded = int(recorded)
    if wanted and wanted != recorded:
        log.warning("namespace %s is split into %d shards (recorded at %s); ignoring shards=%d from the URL",
                    namespace, recorded, shards_key(namespace), wanted)
    return check_shards(recorded)


def agreed_shards(client: RedisCluster, namespace: str, wanted: int | None) -> int:
    return run(shard_count(client, namespace, wanted))


# ---- WAIT on a cluster: a connection of our own per primary ----------------------------------------------------
MOVED_REPLIES = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "READONLY")


# redis-py parses these replies into their own classes (MovedError is an AskError), without the reply's first word
REDIRECTIONS = (redis.exceptions.ExecAbortError, redis.exceptions.AskError, redis.exceptions.TryAgainError,
                redis.exceptions.ClusterDownError, redis.exceptions.ReadOnlyError)


def is_moved(error: BaseException) -> bool:
    """A reply that says the slot is served elsewhere now (or not at all, mid-failover): a redirection, a MULTI that
    one aborted, or a WAIT sent to what has become a replica. By class where redis-py gives one: inside a MULTI it
    re-raises the first queued command's error as 'Command # 1 (...) of pipeline caused error: 1598 host:port', the
    word MOVED gone."""
    if isinstance(error, REDIRECTIONS):
        return True
    text = str(error)
    return isinstance(error, redis.ResponseError) and (text.split(" ", 1)[0] in MOVED_REPLIES or
                                                       "used with replica" in text)


class SlotMoved(redis.ConnectionError):
    """A node link wrote to a node that no longer serves the slot: the topology is read again and the caller's
    retry (every retry-on-outage path treats a ConnectionError as one) goes to the new primary."""


def first_moved(replies: list | dict) -> SlotMoved | None:
    """The SlotMoved to raise when a pipeline's replies (a list, or a dict of them by name) hold a redirection, else
    None."""
    moved = next((r for r in (replies.values() if isinstance(replies, dict) else replies)
                  if isinstance(r, Exception) and is_moved(r)), None)
    return None if moved is None else SlotMoved(f"a shard's slot is served elsewhere now ({moved}); the slots "
                                                "were read again")


class NodeLinks:
    """One single-connection client per primary, for writes a WAIT must count. WAIT counts the writes of its own
    connection, and a cluster client's WAIT has no key to route it to the node that took them, so replicated writes
    on a cluster go through these: the writes of one shard, then WAIT, on the link to the shard's primary."""

    def __init__(self, cluster: RedisCluster, url: str):
        c = parse_cluster_url(url)
        self.cluster, self.links = cluster, {}
        self.kwargs = {"username": c.username, "password": c.password, "ssl": c.ssl, "max_connections": 1,
                       "socket_timeout": 10, "socket_connect_timeout": 2}

    def link(self, key: str) -> redis.Redis:
        node = self.cluster.get_node_from_key(key)
        if node.name not in self.links:
            self.links[node.name] = redis.Redis(host=node.host, port=node.port, **self.kwargs)
        return self.links[node.name]

    def run(self, key: str, writes):
        """`writes(link)` on the link to `key`'s primary. A dead primary (ConnectionError) or a slot served elsewhere
        now (a redirection among the replies, or raised) reads the slots again and raises a ConnectionError, so the
        caller's retry goes to the new primary; other errors stay the caller's."""
        return run(self.run_steps(key, lambda link: returning(writes(link))))

    def run_steps(self, key: str, writes) -> Steps:
        """`run` as steps (steps.py), with `writes(link)` steps too: AsyncNodeLinks's links are redis.asyncio."""
        try:
            replies = yield from writes(self.link(key))
        except redis.ConnectionError:
            yield self.forget
            raise
        except redis.ResponseError as e:
            if is_moved(e):
                yield self.forget
                raise SlotMoved(f"a shard's slot is served elsewhere now ({e}); the slots were read again") from e
            raise
        if (moved := first_moved(replies)) is not None:
            yield self.forget
            raise moved
        return replies

    def forget(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
        self.cluster.nodes_manager.initialize()

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()


class AsyncNodeLinks(NodeLinks):
    """NodeLinks on redis.asyncio: run_steps, driven by steps.run_async."""

    def link(self, key: str):
        import redis.asyncio as aioredis

        node = self.cluster.get_node_from_key(key)
        if node.name not in self.links:
            self.links[node.name] = aioredis.Redis(host=node.host, port=node.port, **self.kwargs)
        return self.links[node.name]

    async def forget(self) -> None:
        await self.close()
        await self.cluster.nodes_manager.initialize()

    async def close(self) -> None:
        for link in self.links.values():
            await link.aclose()
        self.links.clear()
