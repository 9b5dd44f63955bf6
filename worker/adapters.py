"""The LoRA adapters a worker serves: every adapter of its model registered in Redis (`{ns}:loras`, Keys.loras), each
read from its own streams `{ns}:jobs:<adapter>:<priority>` like a model of its own.

At start a worker registers its `--lora NAME=PATH` adapters and loads them; it reads the registry again every heartbeat,
and the streams of an adapter registered since join those it reads (they only grow, as lanes do). A job of adapter X is
read only while X has room in the engine's slots (engine.loras.has_room: loaded, or a slot free or idle) and is
otherwise left in Redis for a worker that holds X, unless X's oldest job has waited `lora_aging_ms` longer than the
oldest waiting job of the adapters the worker holds (or than `lora_aging_ms`, where those have none): then any worker
with KV room takes it (aging), so a cold adapter is never starved by hot ones. With fair share on, X's jobs wait in its
tenants' streams, and X's band is read with the other bands of its priority by the tenants' counters (fair.py); the
aging look reads the streams of each band's AGING_TENANTS lowest-counter tenants too. Of the adapters not loaded here, a
read looks at no more than slots are spare: first those whose jobs wait (each heartbeat looks at their streams' oldest
entries and how many wait; a read looks at each once), in an order each worker draws anew, weighted by how many jobs
wait (`order_waiting`), then the others in turns, each worker's turns starting at its own place. By turns alone, a read
looked at the adapters in the registry's order whatever waited: in W-LORA's fleet (bench/lora_fleet.py) the most popular
adapter's backlog, skipped by every worker's first read, waited for its turn or its aging while workers ran half empty.
Longest-waiting first, every worker looked at the same few adapters first (in a backlog all waited about as long): the
first took their jobs, the others' reads came back empty and backed off, and adapters late in that order kept their jobs
in Redis for seconds while workers had free slots and sequences. The adapter is read from its folder on its first job
here (a bad one is that job's error result); a job of an adapter removed from the registry while it waited is answered
with an error result, never left waiting."""
from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import redis

from kvgate.producer.keys import PRIORITIES, Keys, as_text, lora_entry, parse_lora_entry
from kvgate.worker.clock import ServerClock
from kvgate.worker.engine import Engine
from kvgate.worker.settings import WorkerSettings
from kvgate.worker.stream_heads import StreamHeads

log = logging.getLogger("kvgate.worker")
AGING_TENANTS = 4  # fair share: tenants per adapter band whose streams the aging look reads (the lowest counters)
IN_HOST_WEIGHT = 4  # order_waiting counts the jobs of an adapter in host memory (a slot load away, not a read) 4 times
LOOK_AGAIN_S = 0.25  # an idle worker looks at the adapters' streams between heartbeats at most this often



class Adapters:
    def __init__(self, client: redis.Redis, keys: Keys, engine: Engine, base: str, settings: WorkerSettings,
                 clock: ServerClock, metrics: Any) -> None:
        self.client, self.keys, self.engine, self.base, self.metrics = client, keys, engine, base, metrics
        # settings.max_loras: the engine's slots (0: no adapters served)
        self.enabled, self.aging_ms, self.clock = settings.max_loras >= 1, settings.lora_aging_ms, clock
        self.paths: dict[str, str] = {}  # the registered adapters of our model now: name -> folder
        self.registry: dict | None = None  # the registry as last read (raw), to parse it only when it changed
        self.streamed: list[str] = []  # adapters whose streams we read, in the order they joined (never shrinks)
        self.aged: set[str] = set()  # adapters without room here whose oldest job waited past aging_ms
        self.waiting: dict[str, int] = {}  # adapters not loaded here with jobs waiting -> the oldest one's entry ms
        self.backlog: dict[str, int] = {}  # those adapters -> how many of their jobs no worker took yet (at least 1)
        self.rng = random.Random()  # each worker's own draws (order_waiting)
        self.fair, self.looked_at = False, 0.0  # the last look at the streams: under fair share or not, and when
        self.bands_of: list[str] = []  # the adapters served at the last look, and their streams (-> adapter)
        self.bands: dict[str, str] = {}
        self.heads = StreamHeads(client, keys)  # one script a shard: how many jobs wait in each stream, since when
        # adapters not loaded take turns at being read when fewer slots are spare than they are; from a place of the
        # worker's own, so a fleet's first reads look at different adapters
        self.turn = random.randrange(1 << 16)

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
        raw = self.client.hgetall(self.keys.loras())
        if raw == self.registry:  # as at the last read (each heartbeat): 200 entries' JSON not parsed again
            return []
        self.registry = raw
        entries = {as_text(k): parse_lora_entry(v) for k, v in raw.items()}
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

    def sync(self, fair: bool) -> list[str]:
        """On each heartbeat: the adapters registered since (their streams, lanes and bands to read from now on);
        which are aged (`fair`: fair share is active, so jobs wait in tenants' streams too)."""
        new = self.refresh()
        self.check_aging(fair)
        return new

    def beat(self) -> str:
        """The heartbeat's `loras`: the adapters in the engine's slots, its loads and evictions; "" without slots."""
        if not self.enabled:
            return ""
        slots = self.engine.loras
        self.metrics.on_loras(len(slots.loaded), slots.loads, slots.evictions)
        return json.dumps({"loaded": sorted(slots.loaded), "loads": slots.loads, "evictions": slots.evictions},
                          separators=(",", ":"))

    def reads(self, names: tuple[str, ...]) -> ModelsToRead | None:
        """What a read looks at (Refill.models_now); None without adapter slots (all we serve)."""
        return ModelsToRead(self, names) if self.enabled else None

    def to_read_ahead(self) -> list[tuple[str, str]]:
        """The adapters not in host memory here whose jobs wait (the last look's), most jobs first, with their folders:
        what the worker reads ahead (adapter_reads.py's `warm`)."""
        loras = self.engine.loras
        wanted = sorted((a for a in self.waiting if a in self.paths and a not in loras),
                        key=lambda a: self.backlog.get(a, 0), reverse=True)
        return [(a, self.paths[a]) for a in wanted]

    def look_again(self) -> bool:
        """An idle worker's read found nothing: look at the adapters' streams again now (at most every LOOK_AGAIN_S)
        rather than at the next heartbeat; whether jobs of adapters not loaded here wait. The heartbeat's view is up to
        a second old: idle workers read adapters whose jobs others had taken since, found nothing, and waited on those
        streams while other adapters' jobs stayed in Redis (in W-LORA's fleet, a fifth of the workers' time)."""
        if time.monotonic() - self.looked_at < LOOK_AGAIN_S:
            return False
        self.check_aging(self.fair)
        return bool(self.waiting)

    def readable(self, names: tuple[str, ...]) -> list[str]:
        """The model names whose streams a read looks at now: ours; the adapters in a slot with room, and of those
        not loaded at most as many as slots could take them (those with jobs waiting, in order_waiting's draw, then
        the others in turns, so none is always left out); the longest-waiting aged one not among those; and removed
        ones (their jobs get their error result)."""
        loaded = self.engine.loras.loaded
        self.turn += 1
        # aged ones too: an adapter aged at the heartbeat (no room here then) may have room now; left to the one aged
        # adapter a read takes, a whole backlog's tail aged at once waited for slots that were free
        cold = [a for a in self.streamed if a in self.paths and a not in loaded]
        waiting = self.order_waiting([a for a in cold if a in self.waiting])
        rest = [a for a in cold if a not in self.waiting]
        shift = self.turn % len(rest) if rest else 0
        taken = set((waiting + rest[shift:] + rest[:shift])[:self.engine.loras.spare()])
        for a in taken.intersection(waiting):  # looked at once per heartbeat's view: others may have taken its jobs
            del self.waiting[a]
        # one aged adapter a read, the longest-waiting: its jobs wait here for a slot (in the local queue, then first
        # in the engine's, holding every other admission: Flights.adapter_ready); all of them at once (a backlog's
        # tail ages every adapter) filled the queues with jobs of as many adapters, and each read with hundreds of
        # streams
        taken |= set(sorted(self.aged - taken, key=lambda a: self.waiting.get(a, 0))[:1])
        return [*names, *(a for a in self.streamed if a not in self.paths or a in taken or
                          (a in loaded and self.engine.loras.has_room(a)))]

    def order_waiting(self, adapters: list[str]) -> list[str]:
        """Adapters with jobs waiting in the order this read looks at them: drawn without replacement, each with a
        weight of its jobs waiting (Efraimidis-Spirakis keys u ** (1 / w)). An adapter with twice the backlog comes
        first twice as often, so more workers take it as it grows, and workers that drew differently look at
        different adapters rather than all at the same few. An adapter in host memory here counts its jobs
        IN_HOST_WEIGHT times: its job waits for a copy into a slot, a new one's for a read from disk first."""
        loras = self.engine.loras
        return sorted(adapters, key=lambda a: self.rng.random() ** (1 / (max(self.backlog.get(a, 1), 1) * (
            IN_HOST_WEIGHT if a in loras else 1))), reverse=True)

    def check_aging(self, fair: bool) -> None:
        """Which adapters not loaded here have jobs waiting, since when (`waiting`) and how many (`backlog`), and which
        of those without room here are aged (`aged`): their oldest job waited lora_aging_ms longer than the oldest
        waiting job of the adapters loaded here (than lora_aging_ms where those have none). Absolute aging made every
        adapter aged in a backlog, where every job waits long: each worker then read jobs it had no slot for, which
        waited at the head of its engine's queue and stopped every other admission until a slot freed (W-LORA's fleet at
        saturation ran at a third of its jobs/s). With fair share, each band's AGING_TENANTS lowest-counter tenants'
        streams are looked at too (the ones a read would serve first; the band's own stream holds nothing then; without
        fair share that look is not sent: 600 ZRANGEs a heartbeat for 200 adapters). One script a shard over the streams
        (and with fair share one pipeline before it), once per heartbeat."""
        self.fair, self.looked_at = fair, time.monotonic()
        loaded = self.engine.loras.loaded
        served = [a for a in self.streamed if a in self.paths]
        if self.bands_of != served:  # named again only when the adapters served change
            self.bands = {self.keys.jobs(a, p, shard=k): a for a in served for p in PRIORITIES
                          for k in range(len(self.keys.parts))}
            self.bands_of = served
        bands, streams = self.bands, dict(self.bands)
        if bands and fair:
            pipe = self.client.pipeline(transaction=False)
            for band in bands:
                pipe.zrange(Keys.fair_backlog(band), 0, AGING_TENANTS - 1)
            for (band, a), tenants in zip(bands.items(), pipe.execute(raise_on_error=False)):
                if not isinstance(tenants, Exception):
                    streams.update({Keys.tenant_jobs(band, as_text(t)): a for t in tenants})
        heads: dict[str, int] = {}
        backlog: dict[str, int] = {}
        for stream, head in self.heads.look(list(streams)).items():
            a = streams[stream]
            backlog[a] = backlog.get(a, 0) + head.count
            heads[a] = min(heads.get(a, 1 << 62), head.since_ms)
        self.waiting = {a: since for a, since in heads.items() if a not in loaded}
        self.backlog = backlog
        ours = min((since for a, since in heads.items() if a in loaded), default=int(self.clock.now() * 1000))
        self.aged = {a for a, since in self.waiting.items()
                     if ours - since >= self.aging_ms and not self.engine.loras.has_room(a)}


@dataclass(slots=True)
class ModelsToRead:
    """What a worker with adapter slots reads (Refill.models_now): its own model names and the adapters with room
    now (`now`), and for an idle worker whose read found nothing, a fresh look at the adapters' streams
    (`look_again`)."""

    adapters: Adapters
    names: tuple[str, ...]

    def now(self) -> list[str]:
        return self.adapters.readable(self.names)

    def look_again(self) -> bool:
        return self.adapters.look_again()
