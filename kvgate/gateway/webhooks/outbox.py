"""The webhook outbox in Redis: events waiting to be delivered, written in the same script as the transition that
causes them (a batch's final status: batch_store.TRANSITION; a background response's end: WATCHED), drained by every
gateway process (sender.py). Delivery is at least once: an event leaves the outbox only once its receiver answered
2xx, or once its retry time is over (then it is counted failed).

Keys, under the namespace's shard-0 prefix ns (one slot on a Redis Cluster, beside the batches):
  {ns}:webhook:<event id>  hash   body (the event's JSON, as sent), tenant, first (server ms it was written),
                                  attempts, error (the last failure); a failed event keeps it FAILED_KEEP_S
  {ns}:webhooks:due        zset   event id -> when it is next due (server ms); a claimed event is pushed one claim
                                  lease on, so a gateway killed mid-delivery leaves it due again after the lease
  {ns}:webhooks:failed     zset   event ids given up on -> when (server ms), the newest FAILED_KEEP kept
  {ns}:webhooks:counts     hash   delivered, failed, dropped (no receiver configured for its tenant): fleet totals
  {ns}:webhooks:watch      zset   background response ids -> when last looked at (server ms): responses whose
                                  end sends an event once seen
Every time here is the Redis server's clock (TIME), never a gateway's (invariant 9).
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Callable

FAILED_KEEP = 1000  # failed event ids kept for inspection
FAILED_KEEP_S = 7 * 86_400  # how long a failed event's hash is kept

# KEYS: event hash, due zset. ARGV: event JSON, tenant. Used inside other scripts: the caller's transition and the
# event's write are one atomic step.
ADD = """
local function add_event(event_key, due_key, event_id, body, tenant)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', event_key, 'body', body, 'tenant', tenant, 'first', now, 'attempts', 0)
  redis.call('ZADD', due_key, now, event_id)
end
"""

# KEYS: watch zset, event hash, due zset. ARGV: response id, event id, event JSON, tenant. The one gateway whose ZREM
# takes the response off the watch list writes its event: one event per response, however many gateways saw it end.
WATCHED = ADD + """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
add_event(KEYS[2], KEYS[3], ARGV[2], ARGV[3], ARGV[4])
return 1
"""

# KEYS: due zset. ARGV: most events, claim lease ms, prefix of event keys. The due events, each pushed one lease on
# and its attempt counted; returns {now ms, id, body, tenant, attempts, ...}.
CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {tostring(now)}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))) do
  local key = ARGV[3] .. id
  local e = redis.call('HMGET', key, 'body', 'tenant')
  if e[1] then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
    local attempts = redis.call('HINCRBY', key, 'attempts', 1)
    table.insert(out, id); table.insert(out, e[1]); table.insert(out, e[2]); table.insert(out, tostring(attempts))
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return out
"""

# KEYS: due zset, event hash, counts hash. ARGV: event id, the count to add to (delivered or dropped).
DONE = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then redis.call('HINCRBY', KEYS[3], ARGV[2], 1) end
redis.call('DEL', KEYS[2])
return 1
"""

# KEYS: due zset, event hash, counts hash, failed zset. ARGV: event id, backoff ms, retry time ms, error.
# Due again after the backoff, never past first + retry time (one last try there); past it: failed.
RETRY = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local first = tonumber(redis.call('HGET', KEYS[2], 'first') or now)
redis.call('HSET', KEYS[2], 'error', ARGV[4])
local last = first + tonumber(ARGV[3])
if now >= last then
  if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
    redis.call('HINCRBY', KEYS[3], 'failed', 1)
    redis.call('ZADD', KEYS[4], now, ARGV[1])
    redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -""" + str(FAILED_KEEP + 1) + """)
    redis.call('EXPIRE', KEYS[2], """ + str(FAILED_KEEP_S) + """)
  end
  return 'failed'
end
redis.call('ZADD', KEYS[1], 'XX', math.min(now + tonumber(ARGV[2]), last), ARGV[1])
return 'retry'
"""

COUNTS = ("delivered", "failed", "dropped")


def new_event(kind: str, object_id: str, created_at: int) -> tuple[str, str]:
    """An event in OpenAI's shape (openai.types.webhooks: id, object, type, created_at, data.id) and its id; the id is
    also the webhook-id a receiver dedupes on."""
    event_id = "evt_" + secrets.token_hex(12)
    body = {"id": event_id, "object": "event", "type": kind, "created_at": created_at, "data": {"id": object_id}}
    return event_id, json.dumps(body, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class WebhookKeys:
    """The outbox's key names under one prefix (the namespace's shard 0: Keys.prefix)."""

    prefix: str

    def event(self, event_id: str) -> str:
        return f"{self.prefix}:webhook:{event_id}"

    @property
    def due(self) -> str:
        return f"{self.prefix}:webhooks:due"

    @property
    def failed(self) -> str:
        return f"{self.prefix}:webhooks:failed"

    @property
    def counts(self) -> str:
        return f"{self.prefix}:webhooks:counts"

    @property
    def watch(self) -> str:
        return f"{self.prefix}:webhooks:watch"


@dataclass(frozen=True, slots=True)
class Claimed:
    """One event taken for an attempt."""

    id: str
    body: bytes
    tenant: str
    attempts: int


@dataclass(slots=True)
class WebhookCounts:
    """The fleet's totals and what waits now: what `kvgate stats` shows."""

    delivered: int = 0
    failed: int = 0
    dropped: int = 0
    pending: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"delivered": self.delivered, "failed": self.failed, "dropped": self.dropped, "pending": self.pending}


def read_counts(r: Any, keys: WebhookKeys) -> WebhookCounts:
    """From a blocking client (kvgate stats)."""
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.counts)
    pipe.zcard(keys.due)
    counts, pending = pipe.execute()
    got = {k.decode(): int(v) for k, v in counts.items()}
    return WebhookCounts(*(got.get(c, 0) for c in COUNTS), pending=int(pending))


class Outbox:
    """The outbox over an asyncio Redis client; `wants(tenant)`: whether that tenant has a receiver."""

    def __init__(self, r: Any, keys: WebhookKeys, wants: Callable[[str], bool] = lambda tenant: True):
        self.r, self.keys, self.wants = r, keys, wants
        self._watched = r.register_script(WATCHED)
        self._claim = r.register_script(CLAIM)
        self._done = r.register_script(DONE)
        self._retry = r.register_script(RETRY)

    async def watch(self, response_id: str) -> None:
        """A background response whose end sends an event (scored 0: looked at first)."""
        await self.r.zadd(self.keys.watch, {response_id: 0})

    async def watched(self, limit: int) -> list[str]:
        """The `limit` responses looked at longest ago."""
        return [i.decode() for i in await self.r.zrange(self.keys.watch, 0, limit - 1)]

    async def looked_at(self, response_ids: list[str], now_ms: int) -> None:
        """Responses still running go to the back of the watch list, so that every one is looked at in turn."""
        if response_ids:
            await self.r.zadd(self.keys.watch, {rid: now_ms for rid in response_ids}, xx=True)

    async def unwatch(self, response_id: str) -> None:
        await self.r.zrem(self.keys.watch, response_id)

    async def response_ended(self, response_id: str, kind: str, tenant: str, created_at: int) -> bool:
        """The response's event, written once whoever sees its end first; False when another gateway did."""
        event_id, body = new_event(kind, response_id, created_at)
        keys = [self.keys.watch, self.keys.event(event_id), self.keys.due]
        return bool(await self._watched(keys=keys, args=[response_id, event_id, body, tenant]))

    async def claim(self, limit: int, lease_ms: int) -> tuple[int, list[Claimed]]:
        """The Redis server's clock (ms) and the events due now, each held for `lease_ms`."""
        now, *rest = await self._claim(keys=[self.keys.due], args=[limit, lease_ms, self.keys.event("")])
        return int(now), [Claimed(rest[i].decode(), rest[i + 1], rest[i + 2].decode(), int(rest[i + 3]))
                          for i in range(0, len(rest), 4)]

    async def done(self, event_id: str, count: str = "delivered") -> None:
        await self._done(keys=[self.keys.due, self.keys.event(event_id), self.keys.counts], args=[event_id, count])

    async def retry(self, event_id: str, backoff_ms: int, retry_ms: int, error: str) -> str:
        """'retry' (due again after the backoff) or 'failed' (its retry time is over)."""
        keys = [self.keys.due, self.keys.event(event_id), self.keys.counts, self.keys.failed]
        out = await self._retry(keys=keys, args=[event_id, backoff_ms, retry_ms, error[:500]])
        return out.decode() if isinstance(out, bytes) else out
