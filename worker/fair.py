"""Fair share across tenants through the queue: what a worker knows of it, without I/O in the read itself.

With `{ns}:fair` set (`kvgate worker --fair-share on`), producers send each job to its tenant's stream in its band
(`<band>:t:<tenant>`, a band being one model's shared stream of one priority in one shard) and add the tenant to
the band's backlog `<band>:fair`, a sorted set scored by virtual token counters, in one script. The read script
(reader.py) serves a band after its shared stream: the lowest counter first, charging each job read an estimate of
its tokens (prompt plus output budget: the worker's running estimate) over the tenant's weight, lifting a tenant
that was idle to the band's virtual time so it is owed nothing for its idle time (VTC, "Fairness in Serving Large
Language Models", OSDI '24). The counters live in Redis, so every worker of the fleet advances one virtual clock.
Strict priority between bands stays: a band is read only once the bands above it gave what they had.

Latency beside a flood (`fair_preempt_ms`): the order alone gives a waiting tenant the next room anywhere in the
fleet, but when one tenant's backlog has just filled every worker that room is seconds away. So a job of a tenant
running fewer than its share of a full worker's jobs (`Occupancy`), once it has waited fair_preempt_ms, makes room
for itself: the youngest jobs of the tenants over their share there step aside (preempted by recompute, they resume
first; Engine.make_room). A full worker looks for such a job (the read script's preempting look) at most every
busy_poll_ms, one at a time. Between backlogged tenants of equal shares nothing moves: a share is crossed by more
than one job each way before a job steps aside.

Tenants' streams a worker has read sit in `<band>:fair:pending` (scored when first read, and when last looked at),
so a reclaim finds a dead worker's entries there without scanning every tenant's stream.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import redis

from kvgate.producer.protocol import Keys, as_text

log = logging.getLogger("kvgate.worker")
MAX_WEIGHTS = 1000
MAX_CHARGED = 100_000
FAIR_FLUSH_S = 0.2  # counters' corrections go out this often (one pipeline; none when there are none)  # tenants with a weight passed to each read; the rest weigh 1
FAIR_BLOCK_MS = 50  # an idle worker's blocking wait cannot see tenants' streams: it looks again this often


@dataclass(slots=True)
class Fair:
    client: redis.Redis
    keys: Keys
    setting: str  # on | off | keep (worker settings' fair_share)
    bands: set[str] = field(default_factory=set)  # the shared streams of the models we serve
    on: bool = False  # the namespace has fair share now
    active: bool = False  # we read tenants' streams: fair share is on, or a band still has backlogged tenants
    weights: dict[str, float] = field(default_factory=dict)
    charged: dict[str, float] = field(default_factory=dict)  # `stream|entry id` -> tokens its read charged
    corrections: dict[tuple[str, str], float] = field(default_factory=dict)  # (backlog, tenant) -> tokens to add

    def read(self, entries, charge: float) -> None:
        """Remember what each job read from a tenant's stream was charged (a takeover is not charged again)."""
        for e in entries:
            if e.deliveries == 1 and self.band_of(e.stream) is not None:
                self.charged[f"{e.stream}|{e.entry_id}"] = charge
        if len(self.charged) > MAX_CHARGED:  # jobs lost to a takeover never finish here: forget the oldest
            for key in list(self.charged)[:len(self.charged) - MAX_CHARGED]:
                del self.charged[key]

    def finished(self, stream: str, entry_id: str, tenant: str | None, tokens: int) -> None:
        """A job ended: its tenant's counter moves by what it really took (prompt plus generated tokens) minus what
        its read charged, over its weight, as VTC counts. Sent with the next `flush`."""
        charge = self.charged.pop(f"{stream}|{entry_id}", None)
        band = self.band_of(stream)
        if charge is None or band is None:
            return
        tenant = stream[len(band) + 3:]
        key = (Keys.fair_backlog(band), tenant)
        self.corrections[key] = self.corrections.get(key, 0.0) + (tokens - charge) / self.weights.get(tenant, 1.0)

    def flush(self) -> None:
        """The counters' corrections, each only while its tenant is backlogged (XX): one that left comes back at
        the band's virtual time anyway."""
        if not self.corrections:
            return
        pipe = self.client.pipeline(transaction=False)
        for (backlog, tenant), delta in self.corrections.items():
            pipe.zadd(backlog, {tenant: delta}, xx=True, incr=True)
        self.corrections = {}
        pipe.execute(raise_on_error=False)

    def band_of(self, stream: str) -> str | None:
        band, sep, _ = stream.rpartition(":t:")  # tenant names hold no ':'
        return band if sep and band in self.bands else None

    def band_of_job(self, stream: str) -> str:
        """The band a job read from this stream waits in: its tenant's band, else the stream itself."""
        return self.band_of(stream) or stream

    def sync(self) -> None:
        """Set the namespace's switch as our setting says, then read it, the weights and whether any band still
        has backlogged tenants (after fair share was turned off, their streams drain before we stop reading
        them)."""
        pipe = self.client.pipeline(transaction=False)
        if self.setting == "on":
            pipe.set(self.keys.fair(), int(time.time()))
        elif self.setting == "off":
            pipe.delete(self.keys.fair())
        pipe.exists(self.keys.fair())
        pipe.hgetall(self.keys.tenants())
        replies = pipe.execute()[-2:]
        backlogged = False
        if not replies[0]:
            backlogged = any(self._card(band) for band in self.bands)
        was = self.active
        self.on, self.active = bool(replies[0]), bool(replies[0]) or backlogged
        self.weights = parse_weights(replies[1])
        if self.active != was:
            log.info("fair share across tenants %s", "on" if self.active else "off")

    def _card(self, band: str) -> int:
        return self.client.zcard(Keys.fair_backlog(band))


@dataclass(slots=True)
class Occupancy:
    """The jobs a worker runs, by tenant, and who holds more than a share of them. A tenant's share is the running
    jobs over the tenants running plus one (one not running here yet)."""

    counts: dict[str, int]

    @property
    def share(self) -> float:
        return sum(self.counts.values()) / (len(self.counts) + 1)

    @property
    def cap(self) -> int:
        """A tenant running fewer jobs than this here is under its share by more than one."""
        return math.ceil(self.share - 1)

    def under(self, tenant: str) -> bool:
        return self.counts.get(tenant, 0) < self.cap

    def over(self, tenant: str | None = None) -> tuple[str, ...]:
        """The tenants other than this one over their share by more than one job: whose jobs may step aside."""
        return tuple(t for t, n in self.counts.items() if t != tenant and n > self.share + 1)


def parse_weights(raw: dict) -> dict[str, float]:
    """`{ns}:tenants` -> the weights that are not 1; a value that is no positive number counts as 1 (the hash is
    the operator's, but a typo there must not stop a worker)."""
    out: dict[str, float] = {}
    for tenant, value in list((raw or {}).items())[:MAX_WEIGHTS]:
        try:
            weight = float(as_text(value))
        except ValueError:
            continue
        if weight > 0 and weight != 1 and weight == weight and weight < 1e6:
            out[as_text(tenant)] = weight
    return out
