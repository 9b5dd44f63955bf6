"""The LoRA adapters a worker serves: every adapter of its model registered in Redis (`{ns}:loras`, Keys.loras), each
read from its own streams `{ns}:jobs:<adapter>:<priority>` like a model of its own.

At start a worker registers its `--lora NAME=PATH` adapters and loads them; it reads the registry again every
heartbeat, and the streams of an adapter registered since join those it reads (they only grow, as lanes do). A job of
adapter X is read only while X has room in the engine's slots (engine.loras.has_room: loaded, or a slot free or idle) and
is otherwise left in Redis for a worker that holds X, unless X's oldest job has waited `lora_aging_ms`: then any worker
with room takes it (aging), so a cold adapter is never starved by hot ones. With fair share on, X's jobs wait in its
tenants' streams, and X's band is read with the other bands of its priority by the tenants' counters (fair.py). The adapter is read from its folder on
its first job here (a bad one is that job's error result); a job of an adapter removed from the registry while it
waited is answered with an error result, never left waiting."""
from __future__ import annotations

import json
import logging
from typing import Any

import redis

from kvgate.producer.keys import PRIORITIES, Keys, as_text, lora_entry, parse_lora_entry
from kvgate.worker.clock import ServerClock, entry_ms
from kvgate.worker.engine import Engine
from kvgate.worker.settings import WorkerSettings

log = logging.getLogger("kvgate.worker")
AGING_TENANTS = 4  # fair share: tenants per adapter band whose streams the aging look reads (the lowest counters)


class Adapters:
    def __init__(self, client: redis.Redis, keys: Keys, engine: Engine, base: str, settings: WorkerSettings,
                 clock: ServerClock, metrics: Any) -> None:
        self.client, self.keys, self.engine, self.base, self.metrics = client, keys, engine, base, metrics
        # settings.max_loras: the engine's slots (0: no adapters served)
        self.enabled, self.aging_ms, self.clock = settings.max_loras >= 1, settings.lora_aging_ms, clock
        self.paths: dict[str, str] = {}  # the registered adapters of our model now: name -> folder
        self.streamed: list[str] = []  # adapters whose streams we read, in the order they joined (never shrinks)
        self.aged: set[str] = set()  # adapters without room here whose oldest job waited past aging_ms
        self.turn = 0  # adapters not loaded take turns at being read when fewer slots are spare than they are

    def start(self, loras: list[str]) -> list[str]:
        """Register and load `--lora NAME=PATH` adapters (a bad one stops the start, naming it), then read the
        registry; the adapters whose streams we read."""
        if loras and not self.enabled:
            raise ValueError(f"--lora {loras[0]}: this worker has no adapter slots; start it with --max-loras >= 1")
        for entry in loras:
            name, _, path = entry.partition("=")
            self.engine.loras.add(name, path)
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(self.keys.loras(), name, lora_entry(path, self.base))
            pipe.sadd(self.keys.models(), name)
            pipe.execute()
        return self.refresh()

    def refresh(self) -> list[str]:
        """Read the registry; the adapters of our model whose streams we did not read yet."""
        if not self.enabled:
            return []
        entries = {as_text(k): parse_lora_entry(v) for k, v in self.client.hgetall(self.keys.loras()).items()}
        ours = {name: e[0] for name, e in entries.items() if e is not None and e[1] == self.base}
        self.paths = {name: path for name, path in ours.items() if path is not None}  # the others: removed
        new = [name for name in sorted(ours) if name not in self.streamed]  # removed ones too: their jobs answered
        self.streamed += new
        if new:
            log.info("serving LoRA adapters %s of %s", ", ".join(new), self.base)
        return new

    def of_job(self, model: str | None) -> tuple[str | None, str | None]:
        """(the adapter a job of `model` runs with, or None; the refusal of a job whose adapter was removed)."""
        if model in self.paths:
            return model, None
        if model in self.streamed:
            return None, (f"LoRA adapter {model!r} was removed from the fleet's registry while this job waited; "
                          "register it again (kvgate loras add NAME PATH --base MODEL) and resubmit")
        return None, None

    def sync(self) -> list[str]:
        """On each heartbeat: the adapters registered since (their streams, lanes and bands to read from now on);
        which are aged."""
        new = self.refresh()
        self.check_aging()
        return new

    def beat(self) -> str:
        """The heartbeat's `loras`: the adapters in the engine's slots, its loads and evictions; "" without slots."""
        if not self.enabled:
            return ""
        slots = self.engine.loras
        self.metrics.on_loras(len(slots.loaded), slots.loads, slots.evictions)
        return json.dumps({"loaded": sorted(slots.loaded), "loads": slots.loads, "evictions": slots.evictions},
                          separators=(",", ":"))

    def reads(self, names: tuple[str, ...]):
        """What a read looks at (Refill.models_now): `readable(names)`; None without adapter slots (all we serve)."""
        return (lambda: self.readable(names)) if self.enabled else None

    def readable(self, names: tuple[str, ...]) -> list[str]:
        """The model names whose streams a read looks at now: ours; the adapters in a slot with room, and of those
        not loaded at most as many as slots could take them (in turns, so none is always left out); aged ones; and
        removed ones (their jobs get their error result)."""
        loaded = self.engine.loras.loaded
        self.turn += 1
        cold = [a for a in self.streamed if a in self.paths and a not in loaded and a not in self.aged]
        shift = self.turn % len(cold) if cold else 0
        taken = set((cold[shift:] + cold[:shift])[:self.engine.loras.spare()])
        return [*names, *(a for a in self.streamed if a not in self.paths or a in self.aged or a in taken or
                          (a in loaded and self.engine.loras.has_room(a)))]

    def check_aging(self) -> None:
        """Which adapters without room here have a job that waited past aging_ms: round trips over their streams
        (with fair share, each band's AGING_TENANTS lowest counters' tenants' streams too: the ones a read would
        serve first), the group's last delivered id, then the entry after it, once per heartbeat."""
        waiting = [a for a in self.streamed if a in self.paths and not self.engine.loras.has_room(a)]
        streams = [(a, self.keys.jobs(a, p, shard=k)) for a in waiting for p in PRIORITIES
                   for k in range(len(self.keys.parts))]
        if not streams:
            self.aged = set()
            return
        pipe = self.client.pipeline(transaction=False)
        for _, band in streams:
            pipe.zrange(Keys.fair_backlog(band), 0, AGING_TENANTS - 1)
        backlogs = pipe.execute(raise_on_error=False)
        streams += [(a, Keys.tenant_jobs(band, as_text(t))) for (a, band), tenants in zip(list(streams), backlogs)
                    if not isinstance(tenants, Exception) for t in tenants]
        pipe = self.client.pipeline(transaction=False)
        for _, stream in streams:
            pipe.xinfo_groups(stream)
        delivered = [_last_delivered(g) for g in pipe.execute(raise_on_error=False)]
        pipe = self.client.pipeline(transaction=False)
        for (_, stream), after in zip(streams, delivered):
            pipe.xrange(stream, f"({after}", "+", count=1)
        now_ms = int(self.clock.now() * 1000)
        self.aged = {a for (a, _), first in zip(streams, pipe.execute(raise_on_error=False))
                     if first and not isinstance(first, Exception)
                     and now_ms - entry_ms(as_text(first[0][0])) >= self.aging_ms}


def _last_delivered(groups) -> str:
    if isinstance(groups, Exception):
        return "0-0"
    return next((as_text(g["last-delivered-id"]) for g in groups if as_text(g.get("name")) == Keys.GROUP), "0-0")
