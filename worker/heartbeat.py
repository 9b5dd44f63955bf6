"""The worker's heartbeat hash `{ns}:worker:<id>` with a TTL, and its entry in the registry `{ns}:workers`: what it can
take and what it is doing. Readers list workers from the registry (one ZRANGEBYSCORE) instead of scanning key
names, which on a busy Redis means walking millions of result and reply keys."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from kvgate.producer.keys import HEARTBEAT_FIELDS, Keys

# KEYS: the heartbeat hash, the registry; ARGV: ttl in s, worker id, then field, value pairs. The registry's score is
# when the hash expires, on the server's clock; members past it are dropped here, so the set holds about as many
# ids as there are live workers whatever the churn of pods.
BEAT_LUA = """
local ttl = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. now)
redis.call('ZADD', KEYS[2], now + ttl * 1000, ARGV[2])
return now
"""
STOP_LUA = """
redis.call('DEL', KEYS[1])
return redis.call('ZREM', KEYS[2], ARGV[1])
"""


def write_beat(client: redis.Redis, keys: Keys, worker_id: str, values: dict, ttl_s: int, script=None) -> None:
    """Write a heartbeat's fields with its TTL and refresh the worker's registry entry, in one script call."""
    script = script or client.register_script(BEAT_LUA)
    pairs = [x for name, value in values.items() for x in (name, value)]
    script(keys=[keys.worker(worker_id), keys.workers()], args=[ttl_s, worker_id, *pairs])  # shard 0: one slot


def engine_capacity(engine) -> int:
    """The batch cap the engine was built with, as the engine holds it; a worker setting is only a request."""
    capacity = engine.max_num_seqs
    if not isinstance(capacity, int) or capacity < 1:
        raise TypeError(f"{type(engine).__name__} reports max_num_seqs={capacity!r}, not a positive integer")
    return capacity


@dataclass(slots=True)
class Heartbeat:
    client: redis.Redis
    keys: Keys
    worker_id: str
    model: str
    models: str  # every name served, comma-separated
    max_num_seqs: int
    ttl_s: int
    fim: str = ""  # the model's fill-in-the-middle family (engine/fim.py); "": it has none
    started_at: float = field(default_factory=time.time)
    _last_tokens: int = 0
    _last_time: float = field(default_factory=time.monotonic)
    _beat: object = None
    _stop: object = None

    def __post_init__(self) -> None:
        self._beat = self.client.register_script(BEAT_LUA)
        self._stop = self.client.register_script(STOP_LUA)

    def beat(self, *, state: str, stats, admissible_tokens: int, waiting: int, jobs_done: int,
             tenants: dict[str, list[int]] | None = None, loras: str = "") -> None:
        """`tenants`: TenantLoad.snapshot(), per tenant running jobs, tokens and queue wait counts (bounded)."""
        now = time.monotonic()
        tokens_per_s = (stats.generation_tokens - self._last_tokens) / max(now - self._last_time, 1e-6)
        self._last_tokens, self._last_time = stats.generation_tokens, now
        values = dict(worker_id=self.worker_id, model=self.model, models=self.models,
                      started_at=self.started_at, updated_at=time.time(),
                      state=state, running=stats.running, waiting=waiting + stats.waiting,
                      max_num_seqs=self.max_num_seqs, free_blocks=stats.free_blocks, total_blocks=stats.total_blocks,
                      block_size=stats.block_size, admissible_tokens=admissible_tokens,
                      tokens_per_s=round(max(tokens_per_s, 0.0), 2), jobs_done=jobs_done,
                      tenants=json.dumps(tenants or {}, separators=(",", ":")), fim=self.fim, loras=loras)
        assert set(values) == set(HEARTBEAT_FIELDS)
        write_beat(self.client, self.keys, self.worker_id, values, self.ttl_s, self._beat)

    def stop(self) -> None:
        self._stop(keys=[self.keys.worker(self.worker_id), self.keys.workers()], args=[self.worker_id])
