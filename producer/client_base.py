"""What the Client and the AsyncClient share: their settings and state, and every Redis round trip as steps.

Submitting (the backlog gate, the lane count, group creation, the enqueue with its retries), reading a result,
a job's status, a cancel and the queue's stats are written here once as step functions (steps.py). The Client runs
them with blocking calls (`steps.run`), the AsyncClient awaits them on redis.asyncio (`steps.run_async`): each
client only starts its reply readers, waits in its own way and says which handle it returns.
"""
from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Iterable, Literal

import redis
from tqdm.auto import tqdm

from .connection import refusal_of, resolve_url
from .durable import DurableSubmitter, with_claim
from .errors import FieldError, InvalidRequest, JobFailed, KvgateError, PartiallySubmitted
from .idempotency import owner_tag
from .job_status import job_status
from .lane_count import LaneCount
from .loras import add_lora, list_loras, on_adapters, remove_lora
from .mailbox import ReplyRouter
from .keys import Keys
from .protocol import check_tenant_name, decode_final
from .queue_stats import backlog, queue_stats
from .quotas import Quota, QuotaLedger, Quotas, over_whole_quota, quotas_of, release, take, tenant_of
from .redis_url import FAILOVER_BUDGET_S, Durability
from .request import plain_messages
from .result import Result
from .spread import TenantSpread
from .steps import Sleep, Steps, call
from .submission import (CANCEL_TTL_S, BacklogGate, Prepared, check_group_replies, group_commands, group_exists,
                         new_models, owners, prepare, send_riding_failovers)
from .take_back import spans_shards, take_back

CHUNK = 256
CLOSED_REPLY_TTL_S = 60  # replies still in flight at close may land; the stream goes soon after
log = logging.getLogger(__name__)


def check_client_id(client_id: str) -> str:
    if not 16 <= len(client_id) <= 128 or any(c.isspace() or c in "{}*?[]" for c in client_id):
        raise ValueError(f"client_id={client_id!r} must have 16 to 128 characters, no whitespace or glob "
                         "characters; leave it out to get an unguessable one")
    return client_id


class ClientBase:
    """A producer bound to one Redis namespace; subclasses give it `redis`, `keys`, `_script`, `_states`,
    `_durable` and `_handle_type`, and run its steps."""

    redis: Any
    keys: Keys
    _durable: DurableSubmitter | None
    _handle_type: type

    def __init__(self, redis_url: str | None = None, namespace: str = "kvgate", *, max_backlog: int | None = None,
                 backpressure: Literal["raise", "wait"] = "raise", client_id: str | None = None,
                 reply_ttl_s: int = 3600, durability: Literal["primary", "replicated"] = "primary",
                 replica_timeout_ms: int = 1000, failover_budget_s: float = FAILOVER_BUDGET_S,
                 tenant: str | None = None, quota: Quota | Quotas | None = None, quota_lease_s: float = 3600.0):
        """durability="replicated": submit returns once a replica holds the job (WAIT 1 replica_timeout_ms), and a
        submit interrupted by a failover is sent again, to the new primary, for up to failover_budget_s (see
        RELIABILITY.md, Failover). tenant: recorded on every job this client submits that names none itself.
        quota: the ceilings of each job's tenant (`default` for jobs with none), counted in Redis with every other
        client and gateway of the namespace; a submit over them raises QuotaExceeded. A job holds its slot until
        its final event reaches this client, or at most quota_lease_s should this client go away first."""
        self.tenant = None if tenant is None else check_tenant_name(tenant)
        self.quotas = quotas_of(quota)
        if quota_lease_s <= 0:
            raise ValueError(f"quota_lease_s={quota_lease_s} must be a positive number of seconds")
        self._quota_lease_s = quota_lease_s
        self._ledger = QuotaLedger()
        self.url = resolve_url(redis_url)
        self.durability = Durability(durability, 1, replica_timeout_ms)
        self._failover_budget_s = failover_budget_s
        self.client_id = check_client_id(client_id or secrets.token_urlsafe(16))
        self._gate = BacklogGate(max_backlog, backpressure)
        self._lane_count = LaneCount()
        self._spreader: TenantSpread | None = None
        self.router = ReplyRouter(self._notify, self._ledger.finished)
        self._grouped: set[str] = set()  # models whose streams have the workers' group
        self._closed = False
        self._open(namespace, reply_ttl_s)

    def _open(self, namespace: str, reply_ttl_s: int) -> None:
        """Connect: the client's own I/O."""
        raise NotImplementedError

    def _notify(self) -> None:
        raise NotImplementedError

    # -- submitting -------------------------------------------------------------------------------
    def _submit_many(self, requests: Iterable[dict[str, Any]], progress: bool, chunk_size: int | None,
                     quota: bool = True) -> Steps:
        """Validate every request (InvalidRequest names requests[i].field), then admit them a chunk at a time, each
        chunk whole or not at all (`_enqueue`); chunk_size=None: the whole call is one chunk. A bulk call's chunks
        are at most max_backlog, so each can pass the gate. PartiallySubmitted when a later chunk is refused."""
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be a positive number of jobs, or None for one admission")
        requests = [self._own(plain_messages(r)) for r in requests]
        wheres = [f"requests[{i}]." for i in range(len(requests))]
        requests = yield from on_adapters(self.redis, self.keys, requests, wheres)  # a request's lora=NAME
        lanes = yield from self._lanes()
        fair = self._lane_count.fair
        spread = self._spread()
        prepared = [prepare(r, self.keys, self.client_id, where=where, lanes=lanes, fair=fair, spread=spread)
                    for r, where in zip(requests, wheres)]
        size = max(1, len(prepared)) if chunk_size is None else min(chunk_size, self._gate.max_backlog or chunk_size)
        handles: list = []
        with tqdm(total=len(prepared), unit="job", desc="submit", disable=not progress) as bar:
            for start in range(0, len(prepared), size):
                chunk = prepared[start:start + size]
                try:
                    handles += yield from self._enqueue(chunk, quota, wheres[start:start + size])
                except KvgateError as e:
                    if handles:
                        raise PartiallySubmitted(handles, len(prepared), e) from None
                    raise
                bar.update(len(chunk))
        return handles

    def _submit(self, args: dict[str, Any], lora: str | None = None) -> Steps:
        """One job; `lora=NAME`: on the registered adapter's own streams (on_adapters)."""
        (args,) = yield from on_adapters(self.redis, self.keys, [{**args, "lora": lora}], [""])
        lanes = yield from self._lanes()
        prepared = prepare(self._own(args), self.keys, self.client_id, lanes=lanes, fair=self._lane_count.fair,
                           spread=self._spread())
        return (yield from self._enqueue([prepared]))[0]

    # -- the fleet's adapters (producer/loras.py) ---------------------------------------------------
    def _add_lora(self, name: str, path: str, base: str) -> Steps:
        return (yield from add_lora(self.redis, self.keys, name, path, base))

    def _loras(self) -> Steps:
        return (yield from list_loras(self.redis, self.keys))

    def _remove_lora(self, name: str) -> Steps:
        return (yield from remove_lora(self.redis, self.keys, name))

    def _spread(self) -> TenantSpread | None:
        """Fair share on a cluster deals each tenant's jobs out over the shards (producer/spread.py); made once the
        client knows its shards."""
        if self._spreader is None and len(self.keys.parts) > 1:
            self._spreader = TenantSpread(len(self.keys.parts))
        return self._spreader

    def _own(self, args: Any) -> Any:
        """A submit's arguments with this client's tenant, unless they name one (or are not a dict: validation
        names that)."""
        if self.tenant is None or not isinstance(args, dict) or args.get("tenant") is not None:
            return args
        return {**args, "tenant": self.tenant}

    def _enqueue(self, prepared: list[Prepared], quota: bool = True, wheres: list[str] | None = None) -> Steps:
        """Admit the jobs as one: the backlog gate and their tenants' quotas for all of them, then one enqueue (a
        MULTI; on a cluster one per shard, the earlier ones taken back when a later one fails), or none of it.
        InvalidRequest when no wait can admit them (more than a whole ceiling), Backpressure or QuotaExceeded when
        the ceilings are full for now. `wheres`: each job's argument prefix, for the errors."""
        self._check_fits(prepared, quota, wheres or [""] * len(prepared))
        yield from self._admit(len(prepared))
        enqueued = False
        charged: list[str] = []
        try:
            if quota and self.quotas is not None:
                charged = yield from self._charge(prepared)
            if missing := new_models(prepared, self._grouped):
                yield from self._ensure_groups(missing)
            if self._durable is not None:
                prepared = [with_claim(p, self.keys) for p in prepared]
            replies = yield from self._send(prepared)
            enqueued = True
        finally:
            self._gate.settle(len(prepared), enqueued)
            if not enqueued:
                self._ledger.drop(charged)
        mine = owner_tag(self.client_id)
        claims = owners(prepared, replies)
        self._ledger.drop(p.job.job_id for p, c in zip(prepared, claims) if c.job_id != p.job.job_id)  # a resubmit
        return [self._handle(c.job_id, foreign=c.owner != mine, entry=(p.stream, c.entry) if c.entry else None,
                             parse_as=p.parse_as) for p, c in zip(prepared, claims)]

    def _check_fits(self, prepared: list[Prepared], quota: bool, wheres: list[str]) -> None:
        """InvalidRequest, before anything is counted or sent, for an admission over a whole ceiling: the backlog
        limit, or a tenant's max_jobs or tokens per minute (retrying such a call can never help)."""
        error = self._gate.never_fits(len(prepared))
        if error is None and quota and self.quotas is not None:
            error = over_whole_quota(self.quotas, [p.job for p in prepared], wheres)
        if error is not None:
            raise InvalidRequest([error])

    def _send(self, prepared: list[Prepared]) -> Steps:
        """The jobs' enqueue; when it fails after part of it may have landed (more than one shard), that part is
        taken back (take_back.py) before the error goes on: the caller is told nothing of it was enqueued."""
        replies: list = [None] * len(prepared)
        try:
            if self._durable is not None:
                return (yield from self._durable.send(self._script, prepared, self.keys))
            return (yield from send_riding_failovers(self.redis, self._script, prepared, self.keys,
                                                     self._failover_budget_s, replies))
        except Exception:
            if spans_shards(prepared, self.keys):
                try:
                    yield from take_back(self.redis, prepared, replies, self.keys)
                except Exception as e:  # Redis away: the error below is the caller's; the flags that landed hold
                    log.warning("could not take back a refused admission's %d jobs: %r", len(prepared), e)
            raise

    def _charge(self, prepared: list[Prepared]) -> Steps:
        """Admit the jobs under their tenants' quotas (all or none); QuotaExceeded names the first tenant over."""
        by_tenant: dict[str, list] = {}
        for p in prepared:
            by_tenant.setdefault(tenant_of(p.job), []).append(p.job)
        charged: list[str] = []
        try:
            for tenant, jobs in by_tenant.items():
                charges = yield from take(self.redis, self._quota_take, self.keys, tenant, self.quotas.of(tenant),
                                          jobs, self._quota_lease_s)
                self._ledger.hold(charges)  # before the enqueue: a final may come back before it returns
                charged += [c.job_id for c in charges]
        except BaseException:
            self._ledger.drop(charged)
            raise
        return charged

    def _ensure_groups(self, models: list[str]) -> Steps:
        streams = [st for m in models for st in self.keys.all_jobs(m)]
        pipe = self.redis.pipeline(transaction=False)
        group_commands(pipe, streams)
        replies = yield call(pipe.execute, raise_on_error=False)
        exists = None
        if any(isinstance(r, Exception) and refusal_of(r) for r in replies):  # Redis full: are they there already?
            pipe = self.redis.pipeline(transaction=False)
            for stream in streams:
                pipe.xinfo_groups(stream)
            exists = [group_exists(r) for r in (yield call(pipe.execute, raise_on_error=False))]
        check_group_replies(replies, exists)
        self._grouped.update(models)

    def _lanes(self) -> Steps:
        if self._lane_count.stale():
            try:
                self._lane_count.record(*(yield call(self.redis.mget, [self.keys.lanes(), self.keys.fair()])))
            except redis.RedisError:  # the shared stream is always read: submit goes on without affinity
                self._lane_count.record(None)
        return self._lane_count.lanes

    def _admit(self, n: int) -> Steps:
        """Pass the backlog gate with n jobs, all of them within the limit (reserved in it until their enqueue
        returns), or refuse / wait."""
        delay = 0.02
        while True:
            if self._gate.claim_read():
                try:
                    found = yield from backlog(self.redis, self.keys)
                except BaseException:  # an error, or the caller cancelled: let the next submit read
                    self._gate.read_failed()
                    raise
                self._gate.record(found)
            if not self._gate.blocked(n):
                self._gate.reserve(n)
                return
            if self._gate.mode == "raise":
                raise self._gate.refuse(n)
            yield Sleep(delay)
            delay = min(delay * 2, 1.0)
            self._gate.force()

    # -- embeddings -------------------------------------------------------------------------------
    @staticmethod
    def _embed_requests(inputs: Any, arguments: dict[str, Any]) -> list[dict[str, Any]]:
        """One embedding job per input: a string is a prompt, a list of ints a prompt's token ids; `inputs` may be
        one of those or a list of them. `arguments` are submit's (model, pooling, normalize, dimensions, ...)."""
        if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise InvalidRequest([FieldError("inputs", inputs, "must be a string, a list of token ids, or a non-empty "
                                             "list of either")])
        return [{**arguments, "task": "embed", ("prompt" if isinstance(x, str) else "prompt_token_ids"): x}
                for x in inputs]

    @staticmethod
    def _vectors(results: list[Result]) -> list[list[float]]:
        """The vectors of finished embedding jobs, in order; JobFailed for the first that is not done."""
        for result in results:
            if not result.ok:
                raise JobFailed(result)
        return [result.embedding for result in results]

    # -- results ----------------------------------------------------------------------------------
    def attach(self, job_id: str):
        """A handle for a job submitted elsewhere (another client or process): its result is polled."""
        return self._handle(job_id, foreign=True)

    def _handle(self, job_id: str, foreign: bool, entry: tuple[str, str] | None = None, parse_as=None):
        return self._handle_type(self, self.router.mailbox(job_id, foreign, entry, parse_as))

    def _get(self, job_id: str) -> Steps:
        raw = yield call(self.redis.get, self.keys.result(job_id))
        return None if raw is None else Result.from_final(decode_final(raw))

    def _status(self, job_id: str) -> Steps:
        return (yield from job_status(self.redis, self._states, self.keys, job_id, self.router.entry(job_id)))

    def _cancel(self, job_id: str) -> Steps:
        yield call(self.redis.set, self.keys.cancel(job_id), "1", ex=CANCEL_TTL_S)

    def _release_settled(self) -> Steps:
        """Give back the quota slots of jobs that settled; run by the reply readers after each read."""
        settled = self._ledger.take_settled()
        if settled:
            try:
                yield from release(self.redis, self._quota_release, self.keys, settled)
            except BaseException:
                self._ledger.put_back(settled)
                raise

    def _stats(self) -> Steps:
        return (yield from queue_stats(self.redis, self.keys))

    # -- lifetime ---------------------------------------------------------------------------------
    def _expire_replies(self) -> Steps:
        """At close: give back the quota slots of jobs that settled, and let the reply streams expire; results stay
        readable with get(). (Slots of jobs still running are held until their lease ends.)"""
        yield from self._release_settled()
        for stream in self.keys.replies(self.client_id):
            yield call(self.redis.expire, stream, CLOSED_REPLY_TTL_S)

    @staticmethod
    def _deadline(timeout: float | None) -> float | None:
        return None if timeout is None else time.monotonic() + timeout

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

