"""Which models the gateway answers for: what live workers serve, and what waits for a worker.

Live workers list every name they serve (canonical, aliases, `default`) in their heartbeats (`{ns}:worker:<id>`,
field `models`); a heartbeat expires with its worker. `{ns}:models` holds every name a worker served or an operator
added (producer/model_set.py; never a producer's submit), so a model whose workers scaled to zero is still known,
with its backlog counted from its streams' consumer group (lag plus pending). Every request reads one shared
snapshot of this: when it is older than `--models-cache-s`, one task reads the next (single flight: however many
requests arrive, one read of the fleet is in flight) while requests go on with the last; only a request for a model
the stale snapshot does not accept, or the very first one, waits for the read under way.

A request's model is accepted when a live worker serves it, when it is known (`{ns}:models`), or when the
operator allowed it (`--model`, for models whose autoscaler has never started a worker yet; the gateway adds them
to `{ns}:models` when it starts); with an allow list, only allowed and live models are accepted. Anything else is OpenAI's 404 model_not_found, so a typo
fails at once instead of waiting forever for a worker that will never come.

A registered LoRA adapter (`{ns}:loras`, producer/loras.py) is a model of its own: listed with its `parent` (the base
model) and `root` (its folder) as vLLM lists adapters, and accepted while its base model is. An adapter nobody
registered is a 404 like any unknown model.

Heartbeats also say which fill-in-the-middle format a worker's model has (`fim`, "" for none): a completion with
`suffix` for a model whose live workers all have none is a 400 before anything is queued (check_fim).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import redis
import redis.asyncio as aioredis

from kvgate.producer.lanes import parse_lanes
from kvgate.producer.keys import DEFAULT_MODEL, Keys, as_text, parse_lora_entry

from .errors import ApiError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LiveModel:
    id: str
    created: int  # the start of the oldest live worker serving it; 0 while none does
    workers: int
    backlog: int = 0  # jobs in its streams not yet answered: waiting for a worker or running
    canonical: set[str] = field(default_factory=set)  # the canonical names of the live workers serving it
    # the fill-in-the-middle families its live workers' heartbeats name ("": a model without FIM tokens; a worker
    # from before the field names none)
    fim: set[str] = field(default_factory=set)
    parent: str | None = None  # a LoRA adapter's base model
    root: str | None = None  # a LoRA adapter's folder


@dataclass(slots=True)
class FleetModels:
    live: dict[str, LiveModel]  # served by live workers, with their backlog
    known: dict[str, LiveModel]  # in {ns}:models: served by a worker or added by an operator
    loras: dict[str, LiveModel] = field(default_factory=dict)  # registered adapters ({ns}:loras), with their backlog

    def listed(self, allowed: tuple[str, ...]) -> dict[str, LiveModel]:
        """GET /v1/models: live models and models with a backlog; `default` only while jobs wait in it
        (it names no model, it is whatever the fleet serves); allowed ones, which an autoscaler can start."""
        out = {k: m for k, m in self.known.items() if m.backlog and (not allowed or k in allowed)}
        out |= {k: m for k, m in self.live.items() if k != DEFAULT_MODEL or m.backlog}
        out |= {k: self.known.get(k) or LiveModel(k, 0, 0) for k in allowed if k not in out}
        out |= self.loras
        return dict(sorted(out.items()))


class LiveModels:
    def __init__(self, r: aioredis.Redis, keys: Keys, cache_s: float, allowed: tuple[str, ...] = ()):
        self.r, self.keys, self.cache_s, self.allowed = r, keys, cache_s, allowed
        self.forget()
        self._reading: asyncio.Task | None = None

    async def fleet(self, fresh: bool = False) -> FleetModels:
        """The snapshot; a stale one starts the one refresh, which only the first request (no snapshot yet) and a
        `fresh` caller wait for. The read is shielded: a caller that goes away does not cancel others' read."""
        if not self._stale():
            return self._models
        reading = self._refresh()
        return await asyncio.shield(reading) if fresh or self._models is None else self._models

    def forget(self) -> None:
        """Drop the snapshot (an adapter registered or removed here): the next request waits for a fresh read."""
        self._models: FleetModels | None = None
        self._read_at = float("-inf")  # when the read that made the snapshot started

    def _stale(self) -> bool:
        return time.monotonic() - self._read_at > self.cache_s

    def _refresh(self) -> asyncio.Task:
        if self._reading is None:
            self._reading = asyncio.get_running_loop().create_task(self._read_once(), name="kvgate-fleet-snapshot")
            self._reading.add_done_callback(_report_failure)
        return self._reading

    async def _read_once(self) -> FleetModels:
        started = time.monotonic()
        try:
            models = await self._read()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise ApiError(503, f"the job queue is unreachable ({type(e).__name__}: {e}); retry later",
                           type="server_error", code="queue_unavailable") from e
        finally:
            self._reading = None
        self._models, self._read_at = models, started
        return models

    async def get(self) -> dict[str, LiveModel]:
        """GET /v1/models: a snapshot at most --models-cache-s old (not the hot path: it waits for the read)."""
        return (await self.fleet(fresh=True)).listed(self.allowed)

    async def close(self) -> None:
        if (reading := self._reading) is not None:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)

    async def _read(self) -> FleetModels:
        # the registry's members, expired or not: a member whose heartbeat hash is gone answers no model below
        ids = await self.r.zrange(self.keys.workers(), 0, -1)
        pipe = self.r.pipeline(transaction=False)
        pipe.smembers(self.keys.models())
        pipe.get(self.keys.lanes())
        pipe.hgetall(self.keys.loras())
        for worker_id in ids:
            pipe.hmget(self.keys.worker(as_text(worker_id)), "model", "models", "started_at", "fim")
        known_names, lanes, loras, *beats = await pipe.execute()
        lanes = parse_lanes(lanes)
        live: dict[str, LiveModel] = {}
        for model, models, started, fim in beats:
            if not model:
                continue  # expired between SCAN and HMGET, or a heartbeat without a model
            created = int(float(started or 0))
            for name in as_text(models or model).split(","):
                seen = live.setdefault(name, LiveModel(name, created, 0))
                seen.workers += 1
                seen.created = min(seen.created, created)
                seen.canonical.add(as_text(model))
                if fim is not None:
                    seen.fim.add(as_text(fim))
        known = sorted({as_text(n) for n in known_names} | set(live))
        pipe = self.r.pipeline(transaction=False)
        for name in known:
            for stream in self.keys.all_jobs(name, lanes):
                pipe.xlen(stream)
                pipe.xinfo_groups(stream)
        replies = await pipe.execute(raise_on_error=False)
        models = {name: live.get(name) or LiveModel(name, 0, 0) for name in known}
        for i, name in enumerate(known):
            per_model = 2 * len(self.keys.all_jobs(name, lanes))  # XLEN and XINFO GROUPS of each stream (lanes, shards)
            pairs = replies[per_model * i:per_model * (i + 1)]
            models[name].backlog = sum(_unfinished(n, g) for n, g in zip(pairs[::2], pairs[1::2]))
        for name, value in loras.items():
            entry = parse_lora_entry(value)
            if entry is not None and entry[0] is not None and (adapter := models.get(as_text(name))) is not None:
                adapter.root, adapter.parent = entry  # a removed adapter's tombstone is no model
        return FleetModels({k: m for k, m in models.items() if m.workers}, models,
                           {k: m for k, m in models.items() if m.parent is not None})

    async def served_as(self, model: str) -> str | None:
        """The canonical name an alias will be answered under, when every live worker serving it agrees; streamed
        chunks name it before any result (which carries the name) has arrived."""
        live = (await self.fleet()).live.get(model)
        return next(iter(live.canonical)) if live is not None and len(live.canonical) == 1 else None

    def _accepts(self, fleet: FleetModels, model: str) -> bool:
        if (adapter := fleet.loras.get(model)) is not None:
            model = adapter.parent  # one step: an adapter's base is a model, never another adapter
        return model in fleet.live or model in self.allowed or (not self.allowed and model in fleet.known)

    async def check(self, model: str) -> None:
        """Refuse a model nobody serves, nobody asked for before and the operator did not allow; a stale snapshot
        that would refuse it is read again first (joining the read under way)."""
        fleet = await self.fleet()
        if self._accepts(fleet, model) or (self._stale() and self._accepts(fleet := await self.fleet(True), model)):
            return
        served = sorted(set(fleet.live) - {DEFAULT_MODEL})
        startable = sorted(set(self.allowed or fleet.known) - set(fleet.live) - {DEFAULT_MODEL})
        raise ApiError(404, f"model {model!r} is not served by any live worker and not known to the fleet; served "
                            f"now: {served}; known, waiting for a worker: {startable} (GET /v1/models)",
                       param="model", code="model_not_found")

    async def check_fim(self, model: str) -> None:
        """Refuse `suffix` (fill-in-the-middle) before queueing when every live worker serving `model` says its model
        has no FIM tokens; with none live, or one that may have them, the job goes on (a worker without them
        answers it with an error the request gets as a 400)."""
        fleet = await self.fleet()
        if self._lacks_fim(fleet, model) and (not self._stale() or self._lacks_fim(await self.fleet(True), model)):
            raise ApiError(400, f"suffix: model {model!r} has no fill-in-the-middle tokens in its tokenizer (its live "
                                f"workers say so), so it cannot complete between a prompt and a suffix; send the "
                                "prompt alone, or suffix to a model with FIM tokens (docs/gateway/index.md: "
                                "completions knobs)",
                           param="suffix", code="fill_in_the_middle_unsupported")

    @staticmethod
    def _lacks_fim(fleet: FleetModels, model: str) -> bool:
        live = fleet.live.get(model)
        return live is not None and live.fim == {""}


def _report_failure(task: asyncio.Task) -> None:
    """A refresh nobody waited for failed: requests go on with the last snapshot; say why once per failed read."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("fleet snapshot not refreshed: %s", task.exception())


def _unfinished(length, groups) -> int:
    """Jobs of one stream not yet answered: undelivered (lag) plus in flight (pending). Acknowledged entries stay
    until the next trim, so the length alone would count finished jobs; without a lag field (Redis 6.2), or
    without a group, the length is the fallback."""
    if isinstance(length, Exception) or not length:
        return 0
    group = next((g for g in groups if as_text(g["name"]) == Keys.GROUP), None) \
        if not isinstance(groups, Exception) else None
    if group is None or group.get("lag") is None:
        return int(length)
    return int(group["lag"]) + int(group["pending"])


def model_object(m: LiveModel) -> dict:
    """OpenAI's model object, with vLLM's `root` and `parent` (a LoRA adapter's folder and base model)."""
    return {"id": m.id, "object": "model", "created": m.created, "owned_by": "kvgate", "root": m.root or m.id,
            "parent": m.parent, "live_workers": m.workers, "backlog": m.backlog}
