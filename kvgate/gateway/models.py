"""The models live workers serve, read from their heartbeats (`{ns}:worker:<id>`, field `model`).

A heartbeat expires with its worker, so every hash present is a live worker. The list is cached for
a moment: it is read on every request, to refuse a model no live worker serves.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from kvgate.producer.protocol import Keys

from .errors import ApiError


@dataclass(slots=True)
class LiveModel:
    id: str
    created: int  # the start of the oldest live worker serving it
    workers: int


class LiveModels:
    def __init__(self, r: aioredis.Redis, keys: Keys, cache_s: float):
        self.r, self.keys, self.cache_s = r, keys, cache_s
        self._models: dict[str, LiveModel] = {}
        self._read_at = float("-inf")

    async def get(self) -> dict[str, LiveModel]:
        if time.monotonic() - self._read_at > self.cache_s:
            self._models = await self._read()
            self._read_at = time.monotonic()
        return self._models

    async def _read(self) -> dict[str, LiveModel]:
        names = [name async for name in self.r.scan_iter(match=self.keys.worker_pattern(), count=1000)]
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, "model", "started_at")
        models: dict[str, LiveModel] = {}
        for model, started in await pipe.execute():
            if not model:
                continue  # expired between SCAN and HMGET, or a heartbeat without a model
            model, created = model.decode(), int(float(started or 0))
            seen = models.get(model)
            if seen is None:
                models[model] = LiveModel(model, created, 1)
            else:
                seen.workers += 1
                seen.created = min(seen.created, created)
        return models

    async def check(self, model: str) -> None:
        """Refuse a model no live worker serves. With no live worker at all the job is accepted: it waits
        in Redis for the autoscaler to start one (scale from zero)."""
        models = await self.get()
        if models and model not in models:
            raise ApiError(404, f"model {model!r} is not served by any live worker; served now: {sorted(models)} "
                                "(GET /v1/models)", param="model", code="model_not_found")


def model_object(m: LiveModel) -> dict:
    return {"id": m.id, "object": "model", "created": m.created, "owned_by": "kvgate"}
