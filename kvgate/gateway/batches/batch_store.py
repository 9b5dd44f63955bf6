"""Batches' durable state in Redis, the store the fleet already trusts.

Keys, under the namespace ns:
  {ns}:batch:<id>          hash   the Batch object, one field per attribute (JSON for metadata and errors)
  {ns}:batch:<id>:lines    hash   custom_id -> its output or error line, as JSON; written once per custom_id
  {ns}:batch:<id>:jobs     hash   custom_id -> job id, so a cancel reaches jobs a dead replica submitted
  {ns}:batch:<id>:order    list   every custom_id of the input in order, kept from validation on: the lines the
                                  batch accounts for even when its input file is deleted
  {ns}:batch:<id>:lease    string the token of the one gateway replica driving the batch (SET NX PX, renewed)
  {ns}:batches             zset   every batch id by creation time, for listing (an admin key's list)
  {ns}:batches:tenant:<t>  zset   tenant t's batch ids by creation time, for listing (its keys' list)
  {ns}:batches:active      set    batches not yet in a final state: what a starting gateway resumes
"""
from __future__ import annotations

import inspect
import json
import secrets
import time
from dataclasses import dataclass, fields
from typing import Any, Callable

import redis.asyncio as aioredis

from kvgate.producer.cluster import run_script
from kvgate.producer.limits import DEFAULT_TENANT

from ..webhooks.outbox import ADD as ADD_EVENT, WebhookKeys, new_event

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "cancelled", "expired")
JSON_FIELDS = ("metadata", "errors")
COUNTS = ("total", "completed", "failed")
HIDDEN = ("tenant", "output_expires_s")  # kept, not shown: no such field in OpenAI's Batch
ORDER_CHUNK = 1000  # custom_ids per RPUSH

# KEYS: batch hash, active set, then (with webhooks) the event's hash and the outbox's due zset. ARGV: batch id,
# allowed current statuses (space separated), new status, "1" when it is final, the event's id ("" for none) and
# JSON, then field/value pairs. Moves the status only from an allowed one, so a cancel and the runner never
# overwrite each other; the webhook event of a final status is written in the same step (webhooks/outbox.py).
TRANSITION = ADD_EVENT + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
local allowed = false
for s in string.gmatch(ARGV[2], '%S+') do if s == status then allowed = true end end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[3])
for i = 7, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[4] == '1' then redis.call('SREM', KEYS[2], ARGV[1]) end
if ARGV[5] ~= '' then
  add_event(KEYS[3], KEYS[4], ARGV[5], ARGV[6], redis.call('HGET', KEYS[1], 'tenant') or 'default')
end
return 1
"""

# KEYS: lines hash, batch hash. ARGV: custom_id, line, counter. A custom_id is answered and counted once, even
# when two replicas briefly both think they drive the batch, and only while the batch runs: a replica that lost
# its lease cannot add lines to a batch another one has finalized.
RECORD = """
if redis.call('HGET', KEYS[2], 'status') ~= 'in_progress' then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""

# KEYS: batch hash (any key of the batch's slot, so a Cluster answers from the node that holds the batch). The
# Redis server's clock (invariant 9): a batch's created_at and expires_at are stamped, and its expiry judged, on the
# one clock every replica shares. Returns the status, expires_at and now (seconds, microseconds).
CLOCK = """
local t = redis.call('TIME')
local s = redis.call('HMGET', KEYS[1], 'status', 'expires_at')
return {s[1] or false, s[2] or false, t[1], t[2]}
"""
NOW = "return redis.call('TIME')[1]"  # KEYS: the active set, only to route it to the batches' node

RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


@dataclass(slots=True)
class Batch:
    """openai.types.Batch, field for field."""

    id: str
    endpoint: str
    input_file_id: str
    created_at: int
    expires_at: int
    status: str = "validating"
    completion_window: str = "24h"
    object: str = "batch"
    metadata: dict[str, str] | None = None
    errors: dict | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    tenant: str = DEFAULT_TENANT  # its input file's owner; kept, not shown. Batches from before tenants: default
    output_expires_s: int | None = None  # output_expires_after's seconds: its output and error files expire then

    def body(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in (*COUNTS, *HIDDEN)}
        out["request_counts"] = {"total": self.total, "completed": self.completed, "failed": self.failed}
        return out


def encode_fields(values: dict[str, Any]) -> dict[str, str]:
    return {k: json.dumps(v) if k in JSON_FIELDS else str(v) for k, v in values.items() if v is not None}


def decode_batch(raw: dict[bytes, bytes]) -> Batch:
    known = {f.name: f for f in fields(Batch)}
    values: dict[str, Any] = {}
    for k, v in raw.items():
        name, text = k.decode(), v.decode()
        if name not in known:
            continue
        if name in JSON_FIELDS:
            values[name] = json.loads(text)
        elif name in ("id", "endpoint", "input_file_id", "status", "completion_window", "object",
                      "output_file_id", "error_file_id", "tenant"):
            values[name] = text
        else:
            values[name] = int(text)
    return Batch(**values)


class BatchStore:
    def __init__(self, r: aioredis.Redis, namespace: str, webhooks: Callable[[str], bool] | None = None):
        """`namespace`: the key prefix of the namespace's fleet keys (Keys.prefix: on a Redis Cluster its shard 0, so
        that a batch's keys, its index and the active set share one slot). `webhooks(tenant)`: whether a final status
        of that tenant's batch writes its event (batch.completed, ...) to the webhook outbox."""
        self.r, self.ns, self.webhooks = r, namespace, webhooks
        self.hooks = WebhookKeys(namespace)
        self._transition = r.register_script(TRANSITION)
        self._record = r.register_script(RECORD)
        self._renew = r.register_script(RENEW)
        self._release = r.register_script(RELEASE)
        self._clock = r.register_script(CLOCK)
        self._now = r.register_script(NOW)

    def key(self, batch_id: str, part: str = "") -> str:
        return f"{self.ns}:batch:{batch_id}" + (f":{part}" if part else "")

    @property
    def index(self) -> str:
        return f"{self.ns}:batches"

    def tenant_index(self, tenant: str) -> str:
        return f"{self.ns}:batches:tenant:{tenant}"

    @property
    def active_set(self) -> str:
        return f"{self.ns}:batches:active"

    # -- batch objects ----------------------------------------------------------------------------
    async def create(self, batch: Batch) -> None:
        values = {k: v for k, v in batch.body().items() if k != "request_counts"}
        values |= {"total": 0, "completed": 0, "failed": 0, "tenant": batch.tenant,
                   "output_expires_s": batch.output_expires_s}
        pipe = self.r.pipeline(transaction=True)
        now = time.time()
        pipe.hset(self.key(batch.id), mapping=encode_fields(values))
        pipe.zadd(self.index, {batch.id: now})
        pipe.zadd(self.tenant_index(batch.tenant), {batch.id: now})
        pipe.sadd(self.active_set, batch.id)
        await pipe.execute()

    async def get(self, batch_id: str) -> Batch | None:
        if not batch_id.startswith("batch_") or ":" in batch_id:
            return None
        raw = await self.r.hgetall(self.key(batch_id))
        return decode_batch(raw) if raw else None

    async def status(self, batch_id: str) -> tuple[str | None, int, float]:
        """The status (None: no such batch), expires_at and the Redis server's clock, read afresh together: what a
        running batch checks. A batch is past its window once now >= expires_at."""
        status, expires_at, seconds, micros = await self._clock(keys=[self.key(batch_id)])
        return (status.decode() if status else None), int(expires_at or 0), int(seconds) + int(micros) / 1e6

    async def now(self) -> int:
        """The Redis server's clock in whole seconds, from the node that holds the batches."""
        return int(await self._now(keys=[self.active_set]))

    async def transition(self, batch_id: str, allowed: tuple[str, ...], status: str, **values: Any) -> bool:
        args, keys = [batch_id, " ".join(allowed), status, "1" if status in TERMINAL else "0"], [self.key(batch_id),
                                                                                                 self.active_set]
        stamp = values.get(f"{status}_at")
        if self.webhooks is not None and status in TERMINAL and stamp is not None and self.webhooks(
                (await self.r.hget(self.key(batch_id), "tenant") or DEFAULT_TENANT.encode()).decode()):
            event_id, body = new_event(f"batch.{status}", batch_id, stamp)
            args += [event_id, body]
            keys += [self.hooks.event(event_id), self.hooks.due]
        else:
            args += ["", ""]
        for k, v in encode_fields(values).items():
            args += [k, v]
        return bool(await self._transition(keys=keys, args=args))

    async def set(self, batch_id: str, **values: Any) -> None:
        await self.r.hset(self.key(batch_id), mapping=encode_fields(values))

    async def page(self, limit: int, after: str | None, tenant: str | None = None) -> tuple[list[Batch], bool]:
        """Newest first, one tenant's (None: every tenant's); `after` is the last id of the previous page, as
        OpenAI's cursor pagination has it."""
        index, start = self.index if tenant is None else self.tenant_index(tenant), 0
        if after is not None:
            rank = await self.r.zrevrank(index, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = [i.decode() for i in await self.r.zrevrange(index, start, start + limit)]
        batches = [b for b in [await self.get(i) for i in ids[:limit]] if b is not None]
        return batches, len(ids) > limit

    async def active(self) -> list[str]:
        return sorted(i.decode() for i in await self.r.smembers(self.active_set))

    # -- lines and jobs ---------------------------------------------------------------------------
    async def record(self, batch_id: str, custom_id: str, row: dict, ok: bool) -> bool:
        return (await self.record_many(batch_id, [(custom_id, row, ok)]))[0]

    async def record_many(self, batch_id: str, answers: list[tuple[str, dict, bool]]) -> list[bool]:
        """(custom_id, line, ok) for each answer, in one round trip; True where the line was new."""
        keys = [self.key(batch_id, "lines"), self.key(batch_id)]
        pipe = self.r.pipeline(transaction=False)
        for custom_id, row, ok in answers:
            line = json.dumps(row, ensure_ascii=False)
            queued = run_script(self._record, keys, [custom_id, line, "completed" if ok else "failed"], pipe)
            if inspect.iscoroutine(queued):
                await queued
        return [bool(r) for r in await pipe.execute()]

    async def answered(self, batch_id: str) -> set[str]:
        return {k.decode() for k in await self.r.hkeys(self.key(batch_id, "lines"))}

    async def lines(self, batch_id: str) -> dict[str, str]:
        raw = await self.r.hgetall(self.key(batch_id, "lines"))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def remember_jobs(self, batch_id: str, jobs: dict[str, list[str]]) -> None:
        """custom_id -> the ids of every job the line owns, in input order (a JSON list)."""
        if jobs:
            await self.r.hset(self.key(batch_id, "jobs"), mapping={c: json.dumps(ids) for c, ids in jobs.items()})

    async def jobs(self, batch_id: str) -> dict[str, list[str]]:
        raw = await self.r.hgetall(self.key(batch_id, "jobs"))
        return {k.decode(): _job_ids(v.decode()) for k, v in raw.items()}

    async def keep_order(self, batch_id: str, custom_ids: list[str]) -> None:
        """Before the batch starts: the custom_ids its output and error files must hold, whatever becomes of its
        input."""
        key = self.key(batch_id, "order")
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(key)  # a validation redone after a crash writes the list anew
        for start in range(0, len(custom_ids), ORDER_CHUNK):
            pipe.rpush(key, *custom_ids[start:start + ORDER_CHUNK])
        await pipe.execute()

    async def order(self, batch_id: str) -> list[str] | None:
        """The custom_ids in input order; None for a batch validated before the list was kept."""
        ids = await self.r.lrange(self.key(batch_id, "order"), 0, -1)
        return [i.decode() for i in ids] if ids else None

    async def forget_work(self, batch_id: str) -> None:
        """Once the output and error files hold every line, the per-line state has served its purpose."""
        await self.r.delete(self.key(batch_id, "lines"), self.key(batch_id, "jobs"), self.key(batch_id, "order"))

    # -- the lease --------------------------------------------------------------------------------
    async def acquire(self, batch_id: str, token: str, lease_s: float) -> bool:
        return bool(await self.r.set(self.key(batch_id, "lease"), token, nx=True, px=int(lease_s * 1000)))

    async def renew(self, batch_id: str, token: str, lease_s: float) -> bool:
        return bool(await self._renew(keys=[self.key(batch_id, "lease")], args=[token, int(lease_s * 1000)]))

    async def release(self, batch_id: str, token: str) -> None:
        await self._release(keys=[self.key(batch_id, "lease")], args=[token])


def _job_ids(value: str) -> list[str]:
    """A line's job ids as remembered; a bare id is a line remembered by a gateway from before lines of several jobs
    (one job each), still read so that a batch it started is cancelled whole."""
    return json.loads(value) if value.startswith("[") else [value]
