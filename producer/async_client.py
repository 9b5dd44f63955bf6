"""AsyncClient: the producer SDK on redis.asyncio, with the Client's surface (awaitable where it waits)."""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Iterable, Literal

import redis
import redis.asyncio as aioredis
from tqdm.auto import tqdm

from .async_handle import AsyncJobHandle
from .client import CHUNK, CLOSED_REPLY_TTL_S, check_client_id
from .connection import refusal_of, resolve_url, translated
from .errors import KvgateError, PartiallySubmitted
from .idempotency import owner_tag
from .job_status import JobStatus, job_states_script, job_status, read_states
from .mailbox import ReplyRouter
from .protocol import DEFAULT_MODEL, Keys, decode_final
from .queue_stats import QueueStats, read_queue_stats, total_backlog
from .durable import AsyncDurableSubmitter, with_claim
from .cluster import get_many, is_cluster
from .redis_url import FAILOVER_BUDGET_S, Durability, connect, connect_async, keys_for_async
from .reply_reader import READ_COUNT, ReaderState, is_noperm
from .request import plain_messages, submit_arguments, takes_submit_arguments
from .result import Result
from .lane_count import LaneCount
from .submission import (CANCEL_TTL_S, BacklogGate, Prepared, check_group_replies, claim_script, group_commands,
                         group_exists, new_models, owners, prepare,
                         send_riding_failovers_async)

log = logging.getLogger(__name__)


class AsyncClient:
    """Like Client, for asyncio: `async with AsyncClient(url) as c: r = await (await c.submit(...)).result()`."""

    def __init__(self, redis_url: str | None = None, namespace: str = "kvgate", *, max_backlog: int | None = None,
                 backpressure: Literal["raise", "wait"] = "raise", client_id: str | None = None,
                 reply_ttl_s: int = 3600, durability: Literal["primary", "replicated"] = "primary",
                 replica_timeout_ms: int = 1000, failover_budget_s: float = FAILOVER_BUDGET_S):
        self.url = resolve_url(redis_url)
        self.durability = Durability(durability, 1, replica_timeout_ms)
        self._failover_budget_s = failover_budget_s
        self._durable = AsyncDurableSubmitter(self.url, self.durability, failover_budget_s) \
            if self.durability.replicated else None
        self.namespace = namespace
        self.keys = None if is_cluster(self.url) else Keys(namespace)  # a cluster's shards are read at start()
        self.client_id = check_client_id(client_id or secrets.token_urlsafe(16))
        self._gate = BacklogGate(max_backlog, backpressure)
        self._lane_count = LaneCount()
        self._event = asyncio.Event()
        self.router = ReplyRouter(self._notify)
        self.redis = connect_async(self.url)
        self._script = claim_script(self.redis)
        self._reply_ttl_s = reply_ttl_s
        self._states_by_shard: list[ReaderState] = []
        self._reader: asyncio.Task | None = None  # the reader of shard 0; `_readers` all of them
        self._sync: redis.Redis | None = None  # queue inspection is shared sync code, run in a thread
        self._states = None
        self._closed = False
        self._grouped: set[str] = set()  # models whose streams have the workers' group

    async def start(self) -> "AsyncClient":
        """Create the job groups and start the reply reader; called by `async with` and the first submit."""
        if self._reader is not None:
            return self
        with translated(self.url):
            if self.keys is None:
                self.keys = await keys_for_async(self.url, self.redis, self.namespace)
            await self._ensure_groups([DEFAULT_MODEL])
        self._readers = []
        for shard in range(len(self.keys.parts)):  # one per shard: a blocking read covers one slot
            state = ReaderState(self.keys, self.client_id, self.router, reply_ttl_s=self._reply_ttl_s, shard=shard)
            self._states_by_shard.append(state)
            conn = connect_async(self.url, socket_timeout=state.block_ms / 1000 + 10)
            self._readers.append(asyncio.create_task(self._read(conn, state),
                                                     name=f"kvgate-reply-{self.client_id[:6]}-{shard}"))
        self._reader = self._readers[0]
        return self

    async def _ensure_groups(self, models: list[str]) -> None:
        streams = [st for m in models for st in self.keys.all_jobs(m)]
        pipe = self.redis.pipeline(transaction=False)
        group_commands(pipe, streams)
        replies = await pipe.execute(raise_on_error=False)
        exists = None
        if any(isinstance(r, Exception) and refusal_of(r) for r in replies):  # Redis full: are they there?
            pipe = self.redis.pipeline(transaction=False)
            for stream in streams:
                pipe.xinfo_groups(stream)
            exists = [group_exists(r) for r in await pipe.execute(raise_on_error=False)]
        check_group_replies(replies, exists)
        self._grouped.update(models)

    # -- submitting -------------------------------------------------------------------------------
    @takes_submit_arguments
    async def submit(self, prompt: str | None = None, **arguments) -> AsyncJobHandle:
        """As Client.submit."""
        args = submit_arguments(self, prompt, arguments)
        await self.start()
        prepared = prepare(args, self.keys, self.client_id, lanes=await self._lanes())
        return (await self._enqueue([prepared]))[0]

    async def submit_many(self, requests: Iterable[dict[str, Any]], progress: bool = False,
                          chunk_size: int = CHUNK) -> list[AsyncJobHandle]:
        await self.start()
        lanes = await self._lanes()
        prepared = [prepare(plain_messages(r), self.keys, self.client_id, where=f"requests[{i}].", lanes=lanes)
                    for i, r in enumerate(requests)]
        handles: list[AsyncJobHandle] = []
        with tqdm(total=len(prepared), unit="job", desc="submit", disable=not progress) as bar:
            for start in range(0, len(prepared), chunk_size):
                try:
                    handles += await self._enqueue(prepared[start:start + chunk_size])
                except KvgateError as e:
                    if handles:
                        raise PartiallySubmitted(handles, len(prepared), e) from None
                    raise
                bar.update(min(chunk_size, len(prepared) - start))
        return handles

    async def _enqueue(self, prepared: list[Prepared]) -> list[AsyncJobHandle]:
        await self.start()
        await self._admit()
        with translated(self.url):
            if missing := new_models(prepared, self._grouped):
                await self._ensure_groups(missing)
            if self._durable is not None:
                prepared = [with_claim(p, self.keys) for p in prepared]
                replies = await self._durable.send(self._script, prepared, self.keys)
            else:
                replies = await send_riding_failovers_async(self.redis, self._script, prepared, self.keys,
                                                            self._failover_budget_s)  # as Client._enqueue
        self._gate.added(len(prepared))
        mine = owner_tag(self.client_id)
        return [self._handle(c.job_id, foreign=c.owner != mine, entry=(p.stream, c.entry) if c.entry else None)
                for p, c in zip(prepared, owners(prepared, replies))]

    async def _lanes(self) -> int:
        if self._lane_count.stale():
            try:
                self._lane_count.record(await self.redis.get(self.keys.lanes()))
            except redis.RedisError:  # the shared stream is always read: submit goes on without affinity
                self._lane_count.record(None)
        return self._lane_count.lanes

    async def _admit(self) -> None:
        delay = 0.02
        while True:
            if self._gate.stale():
                with translated(self.url):
                    self._gate.record(await asyncio.to_thread(total_backlog, self._sync_redis(), self.keys))
            if not self._gate.blocked():
                return
            if self._gate.mode == "raise":
                raise self._gate.refuse()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
            self._gate.force()

    # -- results ----------------------------------------------------------------------------------
    def attach(self, job_id: str) -> AsyncJobHandle:
        return self._handle(job_id, foreign=True)

    def _handle(self, job_id: str, foreign: bool, entry: tuple[str, str] | None = None) -> AsyncJobHandle:
        return AsyncJobHandle(self, self.router.mailbox(job_id, foreign, entry))

    async def status(self, job_id: str) -> JobStatus:
        """As Client.status: queued / running (on which worker) / finished / lost / unknown."""
        await self.start()  # on a cluster, the shards are known from then on
        r, entry = self._sync_redis(), self.router.entry(job_id)
        with translated(self.url):
            return await asyncio.to_thread(job_status, r, self._states_script(), self.keys, job_id, entry)

    def _states_script(self):
        if self._states is None:
            self._states = job_states_script(self._sync_redis())
        return self._states

    async def get(self, job_id: str) -> Result | None:
        await self.start()  # on a cluster, the shards are known from then on
        with translated(self.url):
            raw = await self.redis.get(self.keys.result(job_id))
        return None if raw is None else Result.from_final(decode_final(raw))

    async def cancel(self, job_id: str) -> None:
        await self.start()  # on a cluster, the shards are known from then on
        with translated(self.url):
            await self.redis.set(self.keys.cancel(job_id), "1", ex=CANCEL_TTL_S)

    async def stats(self) -> QueueStats:
        await self.start()  # on a cluster, the shards are known from then on
        with translated(self.url):
            return await asyncio.to_thread(read_queue_stats, self._sync_redis(), self.keys)

    def _sync_redis(self) -> redis.Redis:
        if self._sync is None:
            self._sync = connect(self.url)
        return self._sync

    # -- the reader task --------------------------------------------------------------------------
    async def _read(self, conn: aioredis.Redis, state: ReaderState) -> None:
        backoff = 0.05
        try:
            while not self._closed:
                try:
                    await self._step(conn, state)
                    backoff = 0.05
                except Exception as e:
                    if self._closed:  # redis-py may turn close's cancellation of a blocking read into its own error
                        break
                    log.warning("reply reader: %r; retrying in %.2f s", e, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
        finally:
            await conn.aclose()

    async def _step(self, conn: aioredis.Redis, s: ReaderState) -> None:
        now = time.monotonic()
        if s.expire_due(now):
            await self._maintain(s, conn.expire(s.stream, s.reply_ttl_s))
        ids = s.polls_due(now)
        for i in range(0, len(ids), 1000):
            s.absorb_results(await get_many(conn, [s.keys.result(j) for j in ids[i:i + 1000]]))
        await self._check_liveness(s, ids)
        response = await conn.xread({s.stream: s.last_id}, count=READ_COUNT, block=s.block_for_ms())
        if s.absorb(response) and s.maintain:
            await self._maintain(s, conn.xtrim(s.stream, minid=s.last_id, approximate=True))

    async def _check_liveness(self, s: ReaderState, ids: list[str]) -> None:
        """The thread reader's check_liveness: the script runs in a thread, the marking here in the loop."""
        suspects = s.suspects(ids)
        if not suspects:
            return
        r, script = self._sync_redis(), self._states_script()
        for stream, jobs in suspects.items():
            try:
                s.absorb_states(await asyncio.to_thread(read_states, r, script, s.keys, stream, jobs))
            except redis.ResponseError as e:
                if not is_noperm(e):
                    raise
                s.liveness_refused(e)
                return

    @staticmethod
    async def _maintain(state: ReaderState, call) -> None:
        try:
            await call
        except redis.exceptions.NoPermissionError as e:  # a read-only reply stream: see ReaderState.refused
            state.refused(e)

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

    _deadline = staticmethod(lambda timeout: None if timeout is None else time.monotonic() + timeout)
    _remaining = staticmethod(lambda d: None if d is None else max(0.0, d - time.monotonic()))

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
                for stream in self.keys.replies(self.client_id):
                    await asyncio.wait_for(self.redis.expire(stream, CLOSED_REPLY_TTL_S), 5)
        except (redis.RedisError, asyncio.TimeoutError):
            pass
        await self.redis.aclose()
        if self._durable is not None:
            await self._durable.close()
        if self._sync is not None:
            self._sync.close()

    async def __aenter__(self) -> "AsyncClient":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()
