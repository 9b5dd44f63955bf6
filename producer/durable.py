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
from .keys import Keys
from .redis_url import Durability, connect, connect_async
from .steps import Steps, call
from .submission import Prepared, across_failover, by_shard, enqueue_commands

AUTO_CLAIM_TTL_S = 3600  # only the retries of one submit read it: far past any failover, far short of a day of keys


def with_claim(p: Prepared, keys: Keys) -> Prepared:
    """The job, enqueued through an idempotency claim so that sending it twice enqueues it once."""
    if p.claim is not None:
        return p
    job = p.job
    claim = Claim(job.job_id, job.job_id, owner_tag(job.client_id))
    return dataclasses.replace(p, claim=claim, claim_key=keys.of_stream(p.stream).idempotency(f"auto:{job.job_id}"),
                               result_prefix=keys.of_stream(p.stream).result(""), claim_ttl_s=AUTO_CLAIM_TTL_S)


def place(replies: list, group: list[int], done: list) -> None:
    """One shard's replies into their jobs' places; a job's own error (a conflicting claim) is the caller's."""
    for i, reply in zip(group, done):
        if isinstance(reply, Exception):
            raise reply
        replies[i] = reply


class DurableSubmitter:
    """Replicated submits: MULTI/EXEC of the claims, then WAIT, on one connection, across failovers. On a Redis
    Cluster, the same per shard, on a link of its own to the shard's primary (cluster.NodeLinks). `send` is steps
    (steps.py): the Client runs them blocking (`blocking`), the AsyncClient on redis.asyncio (`on_asyncio`)."""

    def __init__(self, conn, links: NodeLinks | None, lock, durability: Durability, budget_s: float):
        self.conn, self.links, self.lock = conn, links, lock  # the pipeline and its WAIT must share a connection
        self.durability, self.budget_s = durability, budget_s

    @classmethod
    def blocking(cls, url: str, durability: Durability, budget_s: float) -> "DurableSubmitter":
        conn = connect(url, max_connections=1)
        return cls(conn, NodeLinks(conn, url) if is_cluster(url) else None, threading.Lock(), durability, budget_s)

    @classmethod
    def on_asyncio(cls, url: str, durability: Durability, budget_s: float) -> "DurableSubmitter":
        conn = connect_async(url, max_connections=1)
        return cls(conn, AsyncNodeLinks(conn, url) if is_cluster(url) else None, asyncio.Lock(), durability, budget_s)

    def send(self, script, prepared: list[Prepared], keys: Keys) -> Steps:
        yield self.lock.acquire  # one submit at a time: WAIT counts the connection's writes
        try:
            return (yield from across_failover(lambda: self._once(script, prepared, keys), self.budget_s))
        finally:
            self.lock.release()

    def _once(self, script, prepared: list[Prepared], keys: Keys) -> Steps:
        if self.links is not None:
            return (yield from self._per_shard(script, prepared, keys))
        pipe = self.conn.pipeline(transaction=True)
        yield from enqueue_commands(pipe, script, prepared)
        replies = yield pipe.execute
        self.durability.check((yield call(self.conn.execute_command, "WAIT", self.durability.replicas,
                                          self.durability.timeout_ms)))
        return replies

    def _per_shard(self, script, prepared: list[Prepared], keys: Keys) -> Steps:
        if isinstance(self.links, AsyncNodeLinks):  # redis.asyncio's cluster reads its slots on its first command
            yield self.conn.initialize  # (it returns at once after that): the links are chosen from them
        replies: list = [None] * len(prepared)
        for group in by_shard(prepared, keys):
            def writes(link, jobs=[prepared[i] for i in group]) -> Steps:
                pipe = link.pipeline(transaction=True)
                yield from enqueue_commands(pipe, script, jobs)
                done = yield call(pipe.execute, raise_on_error=False)
                return done + [(yield call(link.execute_command, "WAIT", self.durability.replicas,
                                           self.durability.timeout_ms))]

            *done, acked = yield from self.links.run_steps(prepared[group[0]].stream, writes)
            self.durability.check(acked)
            place(replies, group, done)
        return replies

    def close(self) -> Steps:
        if self.links is not None:
            yield self.links.close
        yield getattr(self.conn, "aclose", self.conn.close)
