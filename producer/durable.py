"""Submitting with durability="replicated": a submit returns only once a replica holds the job.

Each job is enqueued through an idempotency claim (the caller's key, or one made from the job id), then WAIT runs
on the connection that wrote it: WAIT counts only its own connection's writes, so these submits use a client of
their own with exactly one connection, one submit at a time. When the primary dies or WAIT times out, the same
claims are sent again, to the new primary after a failover: a job the old primary lost is enqueued anew, one that
reached a replica is found by its claim, so the caller gets exactly one job either way.
"""
from __future__ import annotations

import asyncio
import threading

from .idempotency import Claim, owner_tag
from .protocol import Keys
from .redis_url import Durability, across_failover, across_failover_async, connect, connect_async
import dataclasses

from .submission import Prepared, enqueue_commands, enqueue_commands_async

AUTO_CLAIM_TTL_S = 3600  # only the retries of one submit read it: far past any failover, far short of a day of keys


def with_claim(p: Prepared, keys: Keys) -> Prepared:
    """The job, enqueued through an idempotency claim so that sending it twice enqueues it once."""
    if p.claim is not None:
        return p
    job = p.job
    claim = Claim(job.job_id, job.job_id, owner_tag(job.client_id))
    return dataclasses.replace(p, claim=claim, claim_key=keys.idempotency(f"auto:{job.job_id}"),
                               result_prefix=keys.result(""), claim_ttl_s=AUTO_CLAIM_TTL_S)


class DurableSubmitter:
    """Client's replicated submits: MULTI/EXEC of the claims, then WAIT, on one connection, across failovers."""

    def __init__(self, url: str, durability: Durability, budget_s: float):
        self.conn = connect(url, max_connections=1)  # the pipeline and its WAIT must share a connection
        self.durability, self.budget_s = durability, budget_s
        self.lock = threading.Lock()

    def send(self, script, prepared: list[Prepared], keys: Keys) -> list:
        with self.lock:
            return across_failover(lambda: self._once(script, prepared, keys), self.budget_s)

    def _once(self, script, prepared: list[Prepared], keys: Keys) -> list:
        pipe = self.conn.pipeline(transaction=True)
        enqueue_commands(pipe, script, prepared, keys)
        replies = pipe.execute()
        self.durability.check(self.conn.execute_command("WAIT", self.durability.replicas, self.durability.timeout_ms))
        return replies

    def close(self) -> None:
        self.conn.close()


class AsyncDurableSubmitter:
    """AsyncClient's twin of DurableSubmitter."""

    def __init__(self, url: str, durability: Durability, budget_s: float):
        self.conn = connect_async(url, max_connections=1)
        self.durability, self.budget_s = durability, budget_s
        self.lock = asyncio.Lock()

    async def send(self, script, prepared: list[Prepared], keys: Keys) -> list:
        async with self.lock:
            return await across_failover_async(lambda: self._once(script, prepared, keys), self.budget_s)

    async def _once(self, script, prepared: list[Prepared], keys: Keys) -> list:
        pipe = self.conn.pipeline(transaction=True)
        await enqueue_commands_async(pipe, script, prepared, keys)
        replies = await pipe.execute()
        reply = await self.conn.execute_command("WAIT", self.durability.replicas, self.durability.timeout_ms)
        self.durability.check(reply)
        return replies

    async def close(self) -> None:
        await self.conn.aclose()
