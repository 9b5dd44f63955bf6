"""The worker's heartbeat hash `{ns}:worker:<id>`: what it can take and what it is doing, with a TTL."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from kvgate.producer.protocol import HEARTBEAT_FIELDS, Keys


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
    started_at: float = field(default_factory=time.time)
    _last_tokens: int = 0
    _last_time: float = field(default_factory=time.monotonic)

    def beat(self, *, state: str, stats, admissible_tokens: int, waiting: int, jobs_done: int) -> None:
        now = time.monotonic()
        tokens_per_s = (stats.generation_tokens - self._last_tokens) / max(now - self._last_time, 1e-6)
        self._last_tokens, self._last_time = stats.generation_tokens, now
        values = dict(worker_id=self.worker_id, model=self.model, models=self.models,
                      started_at=self.started_at, updated_at=time.time(),
                      state=state, running=stats.running, waiting=waiting + stats.waiting,
                      max_num_seqs=self.max_num_seqs, free_blocks=stats.free_blocks, total_blocks=stats.total_blocks,
                      block_size=stats.block_size, admissible_tokens=admissible_tokens,
                      tokens_per_s=round(max(tokens_per_s, 0.0), 2), jobs_done=jobs_done)
        assert set(values) == set(HEARTBEAT_FIELDS)
        key = self.keys.worker(self.worker_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, mapping=values)
        pipe.expire(key, self.ttl_s)
        pipe.execute()

    def stop(self) -> None:
        self.client.delete(self.keys.worker(self.worker_id))
