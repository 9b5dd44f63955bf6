"""AsyncClient: the producer SDK on redis.asyncio, with the Client's surface (awaitable where it waits).

Its logic is ClientBase's steps (client_base.py, steps.py), awaited here: every Redis call, stats and status
included, goes through redis.asyncio on the event loop; no thread, no blocking connection."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

import redis
import redis.asyncio as aioredis

from .async_handle import AsyncJobHandle
from .client_base import CHUNK, ClientBase
from .cluster import is_cluster
from .connection import translated
from .durable import DurableSubmitter
from .job_status import JobStatus, job_states_script
from .keys import DEFAULT_MODEL, Keys
from .loras import Lora
from .queue_stats import QueueStats
from .redis_url import connect_async, keys_for_async
from .reply_reader import ReaderState
from .request import submit_arguments, takes_submit_arguments
from .result import Result
from .steps import run_async
from .quotas import quota_scripts
from .submission import claim_script
from .tracing import enqueue_span

log = logging.getLogger(__name__)
# redis.asyncio does not send a command again when the server closed its pooled connection (a Redis restart), where
# blocking redis-py does: with this, get, status and stats after a restart behave as the Client's. (A cluster client
# follows its nodes' failures on its own.)
RETRY_CLOSED = {"retry_on_error": [redis.ConnectionError, redis.TimeoutError]}


class AsyncClient(ClientBase):
    """Like Client, for asyncio: `async with AsyncClient(url) as c: r = await (await c.submit(...)).result()`."""

    _handle_type = AsyncJobHandle

    def __init__(self, *args, pool_size: int | None = None, pool_timeout_s: float | None = None, **kwargs):
        """As Client; `pool_size`: at most this many connections for commands (the reply readers have their own),
        and a command that finds them all in use waits for one, up to `pool_timeout_s` (None: no bound), instead
        of raising; unset, redis.asyncio's pool, which raises MaxConnectionsError at 100 (a server with many
        concurrent requests, like the gateway, sets it)."""
        self._pool = {"pool_size": pool_size, "pool_timeout_s": pool_timeout_s} if pool_size is not None else {}
        super().__init__(*args, **kwargs)

    def _open(self, namespace: str, reply_ttl_s: int) -> None:
        """Connections only: Redis is first read in start() (`async with`, or the first call that needs it)."""
        self._durable = DurableSubmitter.on_asyncio(self.url, self.durability, self._failover_budget_s) \
            if self.durability.replicated else None
        self.namespace = namespace
        self.keys = None if is_cluster(self.url) else Keys(namespace)  # a cluster's shards are read at start()
        self._event = asyncio.Event()
        self.redis = connect_async(self.url, **self._pool, **({} if is_cluster(self.url) else RETRY_CLOSED))
        self._script = claim_script(self.redis)
        self._quota_take, self._quota_release = quota_scripts(self.redis)
        self._states = job_states_script(self.redis)
        self._reply_ttl_s = reply_ttl_s
        self._states_by_shard: list[ReaderState] = []
        self._reader: asyncio.Task | None = None  # the reader of shard 0; `_readers` all of them

    async def start(self) -> "AsyncClient":
        """Create the job groups and start the reply reader; called by `async with` and the first submit."""
        if self._reader is not None:
            return self
        if self.keys is None:
            with translated(self.url):
                self.keys = await keys_for_async(self.url, self.redis, self.namespace)
        await self._run(self._ensure_groups([DEFAULT_MODEL]), start=False)
        self._readers = []
        for shard in range(len(self.keys.parts)):  # one per shard: a blocking read covers one slot
            state = ReaderState(self.keys, self.client_id, self.router, reply_ttl_s=self._reply_ttl_s, shard=shard,
                                release=self._release_settled)
            self._states_by_shard.append(state)
            conn = connect_async(self.url, socket_timeout=state.block_ms / 1000 + 10)
            self._readers.append(asyncio.create_task(self._read(conn, state),
                                                     name=f"kvgate-reply-{self.client_id[:6]}-{shard}"))
        self._reader = self._readers[0]
        return self

    async def _run(self, steps, start: bool = True):
        if start:
            await self.start()  # on a cluster, the shards are known from then on
        with translated(self.url):
            return await run_async(steps)

    # -- submitting -------------------------------------------------------------------------------
    @takes_submit_arguments
    async def submit(self, prompt: str | None = None, **arguments) -> AsyncJobHandle:
        """As Client.submit."""
        lora = arguments.pop("lora", None)
        with enqueue_span():  # the job's traceparent names it, where the caller traces with OpenTelemetry
            return await self._run(self._submit(submit_arguments(self, prompt, arguments), lora))

    async def submit_many(self, requests: Iterable[dict[str, Any]], progress: bool = False,
                          chunk_size: int | None = CHUNK, quota: bool = True) -> list[AsyncJobHandle]:
        """As Client.submit_many."""
        with enqueue_span():
            return await self._run(self._submit_many(requests, progress, chunk_size, quota))

    async def embed(self, inputs: str | list[int] | list[str] | list[list[int]], *, model: str | None = None,
                    pooling: str = "model", normalize: bool = True, dimensions: int | None = None,
                    timeout: float | None = None, **arguments) -> list[list[float]]:
        """As Client.embed."""
        requests = self._embed_requests(inputs, {**arguments, "model": model, "pooling": pooling,
                                                 "normalize": normalize, "dimensions": dimensions})
        handles = await self.submit_many(requests, chunk_size=None)  # one call, one admission
        deadline = self._deadline(timeout)
        return self._vectors([await h.result(self._remaining(deadline)) for h in handles])

    # -- results ----------------------------------------------------------------------------------
    async def status(self, job_id: str) -> JobStatus:
        """As Client.status: queued / running (on which worker) / finished / lost / unknown."""
        return await self._run(self._status(job_id))

    async def get(self, job_id: str) -> Result | None:
        return await self._run(self._get(job_id))

    async def cancel(self, job_id: str) -> None:
        await self._run(self._cancel(job_id))

    async def stats(self) -> QueueStats:
        return await self._run(self._stats())

    async def add_lora(self, name: str, path: str, base: str) -> bool:
        """As Client.add_lora."""
        return await self._run(self._add_lora(name, path, base))

    async def loras(self) -> dict[str, Lora]:
        """As Client.loras."""
        return await self._run(self._loras())

    async def remove_lora(self, name: str) -> bool:
        """As Client.remove_lora."""
        return await self._run(self._remove_lora(name))

    # -- the reader task --------------------------------------------------------------------------
    async def _read(self, conn: aioredis.Redis, state: ReaderState) -> None:
        backoff, script = 0.05, job_states_script(conn)
        try:
            while not self._closed:
                try:
                    await run_async(state.step(conn, script))
                    backoff = 0.05
                except Exception as e:
                    if self._closed:  # redis-py may turn close's cancellation of a blocking read into its own error
                        break
                    log.warning("reply reader: %r; retrying in %.2f s", e, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
        finally:
            await conn.aclose()

    # -- waiting ----------------------------------------------------------------------------------
    def _notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def _wait_until(self, predicate, timeout: float | None) -> bool:
        deadline = self._deadline(timeout)
        while not predicate():
            if self._reader is None:
                await self.start()
            event, remaining = self._event, self._remaining(deadline)
            if remaining is not None and remaining <= 0:
                return False
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                return predicate()
        return True

    # -- lifetime ---------------------------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            for task in self._readers:
                task.cancel()
            await asyncio.wait(self._readers, timeout=5)
        try:  # bounded: a connection a refused transaction left behind must not hang the close
            if self.keys is not None:
                await asyncio.wait_for(run_async(self._expire_replies()), 5 * len(self.keys.parts))
        except (redis.RedisError, asyncio.TimeoutError):
            pass
        await self.redis.aclose()
        if self._durable is not None:
            await run_async(self._durable.close())

    async def __aenter__(self) -> "AsyncClient":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()
