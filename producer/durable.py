"""Submitting with durability="replicated": a submit returns only once a replica holds the job.

Each job is enqueued through an idempotency claim (the caller's key, or one made from the job id), then WAIT runs
on the connection that wrote it: WAIT counts only its own connection's writes, so these submits use a client of
their own with exactly one connection, one submit at a time. When the primary dies or WAIT times out, the same
claims are sent again, to the new primary after a failover: a job the old primary lost is enqueued anew, one that
reached a replica is found by its claim, so the caller gets exactly one job either way.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading

from .cluster import AsyncNodeLinks, NodeLinks, is_cluster
from .idempotency import Claim, owner_tag
from .protocol import Keys
from .redis_url import Durability, across_failover, across_failover_async, connect, connect_async
from .submission import Prepared, by_shard, enqueue_commands, enqueue_commands_async

AUTO_CLAIM_TTL_S = 3600  # only the retries of one submit read it: far past any failover, far short of a day of keys


def with_claim(p: Prepared, keys: Keys) -> Prepared:
    """The job, enqueued through an idempotency claim so that sending it twice enqueues it once."""
    if p.claim is not None:
        return p
    job = p.job
    claim = Claim(job.job_id, job.job_id, owner_tag(job.client_id))
    return dataclasses.replace(p, claim=claim, claim_key=keys.of_stream(p.stream).idempotency(f"auto:{job.job_id}"),
                               result_prefix=keys.of_stream(p.stream).result(""), claim_ttl_s=AUTO_CLAIM_TTL_S)


class DurableSubmitter:
    """Client's replicated submits: MULTI/EXEC of the claims, then WAIT, on one connection, across failovers. On a
    Redis Cluster, the same per shard, on a link of its own to the shard's primary (cluster.NodeLinks)."""

    def __init__(self, url: str, durability: Durability, budget_s: float):
        self.conn = connect(url, max_connections=1)  # the pipeline and its WAIT must share a connection
        self.links = NodeLinks(self.conn, url) if is_cluster(url) else None
        self.durability, self.budget_s = durability, budget_s
        self.lock = threading.Lock()

    def send(self, script, prepared: list[Prepared], keys: Keys) -> list:
        with self.lock:
            return across_failover(lambda: self._once(script, prepared, keys), self.budget_s)

    def _once(self, script, prepared: list[Prepared], keys: Keys) -> list:
        if self.links is not None:
            return self._per_shard(script, prepared, keys)
        pipe = self.conn.pipeline(transaction=True)
        enqueue_commands(pipe, script, prepared, keys)
        replies = pipe.execute()
        self.durability.check(self.conn.execute_command("WAIT", self.durability.replicas, self.durability.timeout_ms))
        return replies

    def _per_shard(self, script, prepared: list[Prepared], keys: Keys) -> list:
        self.conn.sadd(keys.models(), *sorted({p.model for p in prepared}))
        replies: list = [None] * len(prepared)
        for group in by_shard(prepared, keys):
            def writes(link, jobs=[prepared[i] for i in group]):
                pipe = link.pipeline(transaction=True)
                enqueue_commands(pipe, script, jobs, keys, models=False)
                return pipe.execute(raise_on_error=False) + [link.execute_command(
                    "WAIT", self.durability.replicas, self.durability.timeout_ms)]

            *done, acked = self.links.run(prepared[group[0]].stream, writes)
            self.durability.check(acked)
            for i, reply in zip(group, done):
                if isinstance(reply, Exception):
                    raise reply
                replies[i] = reply
        return replies

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
        self.conn.close()


class AsyncDurableSubmitter:
    """AsyncClient's twin of DurableSubmitter."""

    def __init__(self, url: str, durability: Durability, budget_s: float):
        self.conn = connect_async(url, max_connections=1)
        self.links = AsyncNodeLinks(self.conn, url) if is_cluster(url) else None
        self.durability, self.budget_s = durability, budget_s
        self.lock = asyncio.Lock()

    async def send(self, script, prepared: list[Prepared], keys: Keys) -> list:
        async with self.lock:
            return await across_failover_async(lambda: self._once(script, prepared, keys), self.budget_s)

    async def _once(self, script, prepared: list[Prepared], keys: Keys) -> list:
        if self.links is not None:
            return await self._per_shard(script, prepared, keys)
        pipe = self.conn.pipeline(transaction=True)
        await enqueue_commands_async(pipe, script, prepared, keys)
        replies = await pipe.execute()
        reply = await self.conn.execute_command("WAIT", self.durability.replicas, self.durability.timeout_ms)
        self.durability.check(reply)
        return replies

    async def _per_shard(self, script, prepared: list[Prepared], keys: Keys) -> list:
        await self.conn.sadd(keys.models(), *sorted({p.model for p in prepared}))
        replies: list = [None] * len(prepared)
        for group in by_shard(prepared, keys):
            async def writes(link, jobs=[prepared[i] for i in group]):
                pipe = link.pipeline(transaction=True)
                await enqueue_commands_async(pipe, script, jobs, keys, models=False)
                return await pipe.execute(raise_on_error=False) + [await link.execute_command(
                    "WAIT", self.durability.replicas, self.durability.timeout_ms)]

            *done, acked = await self.links.run(prepared[group[0]].stream, writes)
            self.durability.check(acked)
            for i, reply in zip(group, done):
                if isinstance(reply, Exception):
                    raise reply
                replies[i] = reply
        return replies

    async def close(self) -> None:
        if self.links is not None:
            await self.links.close()
        await self.conn.aclose()
