"""Client: the synchronous producer SDK. Submit jobs, read their results and streamed tokens."""
from __future__ import annotations

import queue
import secrets
import threading
import time
from typing import Any, Iterable, Iterator, Literal

import redis
from tqdm.auto import tqdm

from .connection import refusal_of, resolve_url, translated
from .durable import DurableSubmitter, with_claim
from .errors import KvgateError, PartiallySubmitted, ResultTimeout
from .handle import JobHandle
from .idempotency import owner_tag
from .job_status import JobStatus, job_states_script, job_status
from .mailbox import ReplyRouter
from .protocol import DEFAULT_MODEL, decode_final
from .queue_stats import QueueStats, read_queue_stats, total_backlog
from .redis_url import FAILOVER_BUDGET_S, Durability, connect, keys_for
from .reply_reader import ReaderState, ReplyReader
from .request import plain_messages, submit_arguments, takes_submit_arguments
from .result import Result
from .lane_count import LaneCount
from .submission import (CANCEL_TTL_S, BacklogGate, Prepared, check_group_replies, claim_script, group_commands,
                         group_exists, new_models, owners, prepare, send_riding_failovers)

CHUNK = 256
CLOSED_REPLY_TTL_S = 60  # replies still in flight at close may land; the stream goes soon after


def check_client_id(client_id: str) -> str:
    if not 16 <= len(client_id) <= 128 or any(c.isspace() or c in "{}*?[]" for c in client_id):
        raise ValueError(f"client_id={client_id!r} must have 16 to 128 characters, no whitespace or glob "
                         "characters; leave it out to get an unguessable one")
    return client_id


class Client:
    """A producer bound to one Redis namespace, with its own unguessable reply stream and reader thread."""

    def __init__(self, redis_url: str | None = None, namespace: str = "kvgate", *, max_backlog: int | None = None,
                 backpressure: Literal["raise", "wait"] = "raise", client_id: str | None = None,
                 reply_ttl_s: int = 3600, durability: Literal["primary", "replicated"] = "primary",
                 replica_timeout_ms: int = 1000, failover_budget_s: float = FAILOVER_BUDGET_S):
        """durability="replicated": submit returns once a replica holds the job (WAIT 1 replica_timeout_ms), and a
        submit interrupted by a failover is sent again, to the new primary, for up to failover_budget_s (see
        RELIABILITY.md, Failover)."""
        self.url = resolve_url(redis_url)
        self.durability = Durability(durability, 1, replica_timeout_ms)
        self._failover_budget_s = failover_budget_s
        self._durable = DurableSubmitter(self.url, self.durability, failover_budget_s) \
            if self.durability.replicated else None
        self.client_id = check_client_id(client_id or secrets.token_urlsafe(16))
        self._gate = BacklogGate(max_backlog, backpressure)
        self._lane_count = LaneCount()
        self._changed = threading.Condition()
        self.router = ReplyRouter(self._notify)
        self.redis = connect(self.url)
        with translated(self.url):
            self.keys = keys_for(self.url, self.redis, namespace)  # on a cluster: the namespace's shards
        self._script = claim_script(self.redis)
        self._closed = False
        self._states = job_states_script(self.redis)
        self._grouped: set[str] = set()  # models whose streams have the workers' group
        with translated(self.url):
            self._ensure_groups([DEFAULT_MODEL])
        self._readers = []  # one per shard: a blocking read covers one slot
        for shard in range(len(self.keys.parts)):
            state = ReaderState(self.keys, self.client_id, self.router, reply_ttl_s=reply_ttl_s, shard=shard)
            conn = connect(self.url, socket_timeout=state.block_ms / 1000 + 10)
            self._readers.append(ReplyReader(conn, state, job_states_script(conn)))
            self._readers[-1].start()

    # -- submitting -------------------------------------------------------------------------------
    @takes_submit_arguments
    def submit(self, prompt: str | None = None, **arguments) -> JobHandle:
        """Validate, then enqueue one job on its model's streams (`model=None`: the `default` model, which
        every worker serves unless told not to). Raises InvalidRequest before anything is enqueued. The keywords
        are SubmitRequest's: the sampling fields of wire.Sampling and the job's own (see help())."""
        args = submit_arguments(self, prompt, arguments)
        prepared = prepare(args, self.keys, self.client_id, lanes=self._lanes())
        return self._enqueue([prepared])[0]

    def submit_many(self, requests: Iterable[dict[str, Any]], progress: bool = False,
                    chunk_size: int = CHUNK) -> list[JobHandle]:
        """Validate every request (InvalidRequest names requests[i].field), then enqueue them in chunks of
        `chunk_size`, each one MULTI/EXEC: all of a chunk or none of it. A refusal (ServerRefused: Redis out of
        memory or read-only) in the first chunk enqueued nothing; in a later one, PartiallySubmitted says which
        requests were enqueued (with their handles) and which were not."""
        lanes = self._lanes()
        prepared = [prepare(plain_messages(r), self.keys, self.client_id, where=f"requests[{i}].", lanes=lanes)
                    for i, r in enumerate(requests)]
        handles: list[JobHandle] = []
        with tqdm(total=len(prepared), unit="job", desc="submit", disable=not progress) as bar:
            for start in range(0, len(prepared), chunk_size):
                try:
                    handles += self._enqueue(prepared[start:start + chunk_size])
                except KvgateError as e:
                    if handles:
                        raise PartiallySubmitted(handles, len(prepared), e) from None
                    raise
                bar.update(min(chunk_size, len(prepared) - start))
        return handles

    def _enqueue(self, prepared: list[Prepared]) -> list[JobHandle]:
        self._admit()
        with translated(self.url):
            if missing := new_models(prepared, self._grouped):
                self._ensure_groups(missing)
            if self._durable is not None:
                prepared = [with_claim(p, self.keys) for p in prepared]
                replies = self._durable.send(self._script, prepared, self.keys)
            else:
                replies = send_riding_failovers(self.redis, self._script, prepared, self.keys, self._failover_budget_s)
        self._gate.added(len(prepared))
        mine = owner_tag(self.client_id)
        return [self._handle(c.job_id, foreign=c.owner != mine, entry=(p.stream, c.entry) if c.entry else None)
                for p, c in zip(prepared, owners(prepared, replies))]

    def _ensure_groups(self, models: list[str]) -> None:
        streams = [st for m in models for st in self.keys.all_jobs(m)]
        pipe = self.redis.pipeline(transaction=False)
        group_commands(pipe, streams)
        replies = pipe.execute(raise_on_error=False)
        check_group_replies(replies, self._groups_exist(streams, replies))
        self._grouped.update(models)

    def _groups_exist(self, streams: list[str], replies: list) -> list[bool] | None:
        """Only when a group creation was refused (Redis full or read-only): which groups are there already."""
        if not any(isinstance(r, Exception) and refusal_of(r) for r in replies):
            return None
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        return [group_exists(r) for r in pipe.execute(raise_on_error=False)]

    def _lanes(self) -> int:
        if self._lane_count.stale():
            try:
                self._lane_count.record(self.redis.get(self.keys.lanes()))
            except redis.RedisError:  # the shared stream is always read: submit goes on without affinity
                self._lane_count.record(None)
        return self._lane_count.lanes

    def _admit(self) -> None:
        delay = 0.02
        while True:
            if self._gate.stale():
                with translated(self.url):
                    self._gate.record(total_backlog(self.redis, self.keys))
            if not self._gate.blocked():
                return
            if self._gate.mode == "raise":
                raise self._gate.refuse()
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            self._gate.force()

    # -- results ----------------------------------------------------------------------------------
    def attach(self, job_id: str) -> JobHandle:
        """A handle for a job submitted elsewhere (another client or process): its result is polled."""
        return self._handle(job_id, foreign=True)

    def _handle(self, job_id: str, foreign: bool, entry: tuple[str, str] | None = None) -> JobHandle:
        return JobHandle(self, self.router.mailbox(job_id, foreign, entry))

    def get(self, job_id: str) -> Result | None:
        """The stored result of a finished job, or None while it runs (or after its result expired); see
        status() to tell those apart."""
        with translated(self.url):
            raw = self.redis.get(self.keys.result(job_id))
        return None if raw is None else Result.from_final(decode_final(raw))

    def status(self, job_id: str) -> JobStatus:
        """Where a job is: queued, running (on which worker), finished, lost, or unknown. Exact for jobs this
        client submitted; for another job id, finished and running are found and the rest is 'unknown'."""
        with translated(self.url):
            return job_status(self.redis, self._states, self.keys, job_id, self.router.entry(job_id))

    def cancel(self, job_id: str) -> None:
        with translated(self.url):
            self.redis.set(self.keys.cancel(job_id), "1", ex=CANCEL_TTL_S)

    def as_completed(self, handles: Iterable[JobHandle], timeout: float | None = None) -> Iterator[JobHandle]:
        """Yield handles as their jobs finish; ResultTimeout if `timeout` passes with some still running."""
        waiting = {h.job_id: h for h in handles}
        finished: queue.SimpleQueue[str] = queue.SimpleQueue()
        for h in waiting.values():
            self.router.when_final(h._box, lambda box: finished.put(box.job_id))
        deadline = self._deadline(timeout)
        while waiting:
            try:
                job_id = finished.get(timeout=self._remaining(deadline))
            except queue.Empty:
                raise ResultTimeout(next(iter(waiting)), timeout) from None
            if job_id in waiting:
                yield waiting.pop(job_id)

    def stats(self) -> QueueStats:
        with translated(self.url):
            return read_queue_stats(self.redis, self.keys)

    # -- waiting ----------------------------------------------------------------------------------
    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _wait_until(self, predicate, timeout: float | None) -> bool:
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    @staticmethod
    def _deadline(timeout: float | None) -> float | None:
        return None if timeout is None else time.monotonic() + timeout

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the reader and let the reply stream expire; results stay readable with Client.get."""
        if self._closed:
            return
        self._closed = True
        for reader in self._readers:
            reader.stop(self.redis)
        try:
            for stream in self.keys.replies(self.client_id):
                self.redis.expire(stream, CLOSED_REPLY_TTL_S)
        except redis.RedisError:
            pass
        self.redis.close()
        if self._durable is not None:
            self._durable.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

