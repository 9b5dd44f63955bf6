"""Fair share across tenants through the queue: what a worker knows of it, without I/O in the read itself.

With `{ns}:fair` set (`kvgate worker --fair-share on`), producers send each job to its tenant's stream in its band
(`<band>:t:<tenant>`, a band being one model's shared stream of one priority in one shard) and add the tenant to the
band's backlog `<band>:fair`, a sorted set scored by virtual token counters, in one script. The read script
(reader.py) serves a band after its shared stream: the lowest counter first, charging each job read an estimate of
its tokens (prompt plus output budget: the worker's running estimate) over the tenant's weight, lifting a tenant
that was idle to the band's virtual time (or to the lowest counter waiting, if that is higher) so it is owed nothing
for its idle time (VTC, "Fairness in Serving Large Language Models", OSDI '24). The counters live in Redis, so every
worker of the fleet advances one virtual clock. On a Redis Cluster a band is one shard's: each shard's counters are
its own (a script touches one slot), and a worker adds what a tenant's jobs took in one shard to its counters in the
others (`Fair.queue_spread`, `Fair.flush`), so each shard orders the tenants by what they took in the whole fleet,
and a tenant whose backlog ran out in one shard first is served the more in the others. Strict priority between
bands stays: a band is read only once the bands above it gave what they had.

Latency beside a flood (`fair_preempt_ms`): the order alone gives a waiting tenant the next room anywhere in the
fleet, but when one tenant's backlog has just filled every worker that room is seconds away. So a job of a tenant
that had few jobs waiting (the read script marks it: Entry.may_preempt) and would stay within its share of a full
worker's running jobs (`Occupancy`), once it has waited fair_preempt_ms, makes room for itself: the youngest jobs of
the tenants that give way there (a backlogged tenant at its share, any tenant above it) step aside, as many as it
needs (preempted by recompute, they resume first; Engine.make_room). A full worker looks for such a job (the read
script's preempting look) about every two fair_preempt_ms, jittered, while no job it read waits for room. A backlogged
tenant never makes room, and between tenants with few jobs waiting at their share nothing moves.

Tenants' streams a worker has read sit in `<band>:fair:pending` (scored when first read, and when last looked at),
so a reclaim finds a dead worker's entries there without scanning every tenant's stream. Tenants' streams that
exist sit in `<band>:fair:streams`, which the pruning pass (`Fair.sweep`, SWEEP_LUA) walks a bounded slice at a
time, oldest look first (again SWEEP_AGAIN_S later while slices come full, else every trim interval): it deletes
streams left empty and the departed consumers of the others. An idle worker blocks on the bands' bells
(`<band>:fair:bell`), which producers ring when a tenant joins a backlog (refill.py).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import redis

from kvgate.producer.cluster import run_script
from kvgate.producer.keys import ID_AFTER_LUA, Keys, as_text
from kvgate.worker.tenant_weights import RANGE, clamp_weight, parse_weights

log = logging.getLogger("kvgate.worker")
MAX_CHARGED = 100_000
FAIR_FLUSH_S = 0.2  # what tenants were served goes onto their counters this often (one pipeline; none when nothing was)
# On a Redis Cluster, what a read charged a tenant in one shard goes onto its counters in every other shard, and
# this much more onto its counter in the shard it was read from (the read script charges it: Fair.read_charge).
# Without it the shards specialise: each tenant's counters rise alike everywhere, so the few jobs' worth by which
# its counter in one shard started above the others (where it joined that shard's backlog) holds forever, and that
# shard never serves it while others do. Its backlog there waits to the end, when it sits in one or two shards and
# those shards' turns of the fleet's reads are less than its share (W-FAIR's equal phase on a cluster: one tenant at
# 0.23 in the last window). With it a shard that served a tenant leans to the others and each shard drains its
# tenants together: a start x tokens apart is made up after x / LOCAL_CHARGE tokens of that shard's serving. The
# price: a tenant left in k of n shards gets (1 + LOCAL_CHARGE / n) / (1 + LOCAL_CHARGE / k) of its share there
# (0.93 in 2 of 6), not all of it.
LOCAL_CHARGE = 0.25
FAIR_BLOCK_MS = 50  # an idle worker's wait while a band's backlog still has tenants (a race with another's read)


SWEEP_TENANTS = 64  # tenants' streams one pruning pass looks at per band, the longest unseen first
# After a pass whose slice was full in some band (more may be due now), the next pass comes this soon rather than a
# trim interval later: a drain of 50,000 tenants left 48,465 emptied streams (84 MB) for an hour at one slice per
# 5 s. It costs little more: a stream the pass keeps is looked at again only once min idle (the reclaim timeout) has
# passed, so the fleet's looks stay at most one per stream and reclaim timeout, plus one per stream deleted; only a
# full slice brings the next pass forward, so an idle namespace still costs one pass per trim interval.
SWEEP_AGAIN_S = 0.1

# KEYS: per band (one shard's bands) its streams index, backlog and pending index; ARGV: group, min idle ms, heartbeat
# key prefix ('' on a cluster: see consumers.py), our own consumer, tenants per band, then the bands. Per band, the
# tenants whose stream was last looked at over min idle ago (or never), at most SWEEP_TENANTS: a stream gone (or not
# a stream) is forgotten; one with nothing pending, nothing undelivered and its tenant not backlogged is deleted
# (in this script, in the band's slot, so a producer's XADD cannot slip in between the look and the DEL: its
# next job makes the stream again and joins the index anew, and a reader makes the group on NOGROUP); in any other
# its departed consumers (idle, nothing pending, no heartbeat) are deleted, as consumers.py does for the shared
# streams, and it is looked at again once min idle has passed. Returns {streams deleted, consumers deleted, 1 if some
# band's slice was full (more may be due) else 0}.
SWEEP_LUA = ID_AFTER_LUA + """
local group, min_idle, prefix, me = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local limit = tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deleted, gone, full = 0, {}, 0
for b = 1, #ARGV - 5 do
  local band, known, backlog, pending = ARGV[5 + b], KEYS[3 * b - 2], KEYS[3 * b - 1], KEYS[3 * b]
  local slice = redis.call('ZRANGEBYSCORE', known, '-inf', now - min_idle, 'LIMIT', 0, limit)
  if #slice >= limit then full = 1 end
  for _, tenant in ipairs(slice) do
    local key = band .. ':t:' .. tenant
    local kind = redis.call('TYPE', key)['ok']
    if kind ~= 'stream' then
      redis.call('ZREM', known, tenant)
    else
      local g = nil
      for _, row in ipairs(redis.call('XINFO', 'GROUPS', key)) do
        local f = {}
        for i = 1, #row, 2 do f[row[i]] = row[i + 1] end
        if f['name'] == group then g = f end
      end
      local top = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
      local waiting = top ~= nil and (g == nil or id_after(top[1], g['last-delivered-id']))
      if not waiting and (g == nil or g['pending'] == 0) and not redis.call('ZSCORE', backlog, tenant) then
        redis.call('DEL', key)
        redis.call('ZREM', known, tenant)
        redis.call('ZREM', pending, tenant)
        deleted = deleted + 1
      else
        if g ~= nil then
          for _, row in ipairs(redis.call('XINFO', 'CONSUMERS', key, group)) do
            local c = {}
            for i = 1, #row, 2 do c[row[i]] = row[i + 1] end
            if c['pending'] == 0 and c['idle'] >= min_idle and c['name'] ~= me
                and not (prefix ~= '' and redis.call('EXISTS', prefix .. c['name']) == 1) then
              redis.call('XGROUP', 'DELCONSUMER', key, group, c['name'])
              gone[#gone + 1] = c['name']
            end
          end
        end
        redis.call('ZADD', known, now, tenant)
      end
    end
  end
end
return {deleted, gone, full}
"""


def tenant_of(stream: str, band: str) -> str:
    """The tenant whose stream in `band` this is (Keys.tenant_jobs)."""
    return stream.removeprefix(Keys.tenant_jobs(band, ""))


@dataclass(slots=True, frozen=True)
class Swept:
    """What one pruning pass over the tenants' streams deleted."""

    deleted: int = 0  # tenants' streams left empty
    consumers: list[str] = field(default_factory=list)  # departed consumers' names (each once)
    more: bool = False  # some band's slice was full: more streams may be due now (SWEEP_AGAIN_S)


@dataclass(slots=True)
class Fair:
    client: redis.Redis
    keys: Keys
    setting: str  # on | off | keep (worker settings' fair_share)
    bands: set[str] = field(default_factory=set)  # the shared streams of the models we serve
    on: bool = False  # the namespace has fair share now
    active: bool = False  # we read tenants' streams: fair share is on, or a band still has backlogged tenants
    weights: dict[str, float] = field(default_factory=dict)  # within the range (tenant_weights.py), not 1
    odd_weights: dict[str, str] = field(default_factory=dict)  # `{ns}:tenants` entries clamped or taken as 1, logged
    charged: dict[str, float] = field(default_factory=dict)  # `stream|entry id` -> tokens its read charged
    # (band, tenant) -> weighted tokens to add to the tenant's counters: [charged by reads in that band (on a cluster,
    # for the other shards' counters), corrected when jobs ended (for every shard's)]
    served: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    siblings: dict[str, tuple[str, ...]] = field(default_factory=dict)  # band -> the same band in every shard
    charged_here: bool = False  # a cluster: reads charged counters of one shard that the others lack yet
    script: object = None  # the pruning pass's (SWEEP_LUA), registered at its first use

    def read_charge(self, tokens_per_job: float) -> float:
        """What the read script charges a job's tenant in the shard it was read from: the estimate, and on a Redis
        Cluster LOCAL_CHARGE more (the other shards' counters get the estimate: `read`, `queue_spread`)."""
        return tokens_per_job * (1 + LOCAL_CHARGE) if len(self.keys.parts) > 1 else tokens_per_job

    def read(self, entries, charge: float) -> None:
        """Remember what each job read from a tenant's stream was charged (a takeover is not charged again), and on
        a cluster what its tenant's counters in the other shards are to be charged for it.

        A job read while its tenant was the only one backlogged in its band (Entry.alone) keeps its charge: while
        alone, a tenant's counter only says where a newcomer starts, and the newcomer starts there owed nothing. Its
        correction when the job ends would land after the newcomer joined and move the tenant by the estimate's
        error on every job it had in flight: an idle fleet's first fill read a flood's hundreds of jobs at the cold
        estimate (512 tokens against 376 in W-FAIR's mix), and the refund, after B and C joined, gave A 0.51 of
        the first 5 s window at equal weights."""
        for e in entries:
            band = self.band_of(e.stream) if e.deliveries == 1 else None
            if band is not None:
                if not e.alone:
                    self.charged[f"{e.stream}|{e.entry_id}"] = charge
                if len(self.keys.parts) > 1:  # the read script charged its own shard's counter as READ_LUA does
                    tenant = tenant_of(e.stream, band)
                    self._serve(band, tenant)[0] += max(charge, 1.0) / self.weight(tenant)
                    self.charged_here = True
        if len(self.charged) > MAX_CHARGED:  # jobs lost to a takeover never finish here: forget the oldest
            for key in list(self.charged)[:len(self.charged) - MAX_CHARGED]:
                del self.charged[key]

    def finished(self, stream: str, entry_id: str, tenant: str | None, tokens: int) -> None:
        """A job ended: its tenant's counters move by what it really took (prompt plus generated tokens) minus what
        its read charged, over its weight, as VTC counts. Sent with the next `flush`."""
        charge = self.charged.pop(f"{stream}|{entry_id}", None)
        band = self.band_of(stream)
        if charge is None or band is None:
            return
        tenant = tenant_of(stream, band)
        self._serve(band, tenant)[1] += (tokens - charge) / self.weight(tenant)

    def weight(self, tenant: str) -> float:
        """A tenant's weight, within the range whatever `weights` holds: counters move by numbers."""
        return clamp_weight(self.weights.get(tenant, 1.0))

    def _serve(self, band: str, tenant: str) -> list[float]:
        return self.served.setdefault((band, tenant), [0.0, 0.0])

    def flush(self) -> None:
        """What tenants were served since the last flush, onto their counters, each only where its tenant is
        backlogged (XX: one that left comes back at the band's virtual time anyway). Corrections go to the counters
        of the band in every shard, and on a Redis Cluster so does a read's charge (the read script charged its own
        shard): each shard's counters count what a tenant took in the whole fleet, so where its backlog ran out
        first its other shards serve it the more, and its share of the fleet holds (docs/tenants/fair-share.md). One
        command per tenant and shard a flush, whatever the jobs."""
        if not self.served:
            return
        deltas: dict[tuple[str, str], float] = {}
        for (band, tenant), (charged, corrected) in self.served.items():
            for sibling in self.siblings_of(band):
                delta = corrected + (charged if sibling != band else 0.0)
                if delta:
                    key = (Keys.fair_backlog(sibling), tenant)
                    deltas[key] = deltas.get(key, 0.0) + delta
        self.served, self.charged_here = {}, False
        if not deltas:
            return
        pipe = self.client.pipeline(transaction=False)
        for (backlog, tenant), delta in deltas.items():
            pipe.zadd(backlog, {tenant: delta}, xx=True, incr=True)
        pipe.execute(raise_on_error=False)

    def queue_spread(self, pipe) -> int:
        """On a Redis Cluster, queue on the step's pipeline what reads charged tenants in one shard onto their
        counters in the other shards (the rest waits for `flush`); how many commands. It cannot wait for the flush:
        a tenant that joins another shard's backlog meanwhile starts where the counters are there, below what the
        others took, and is owed it (the idle fleet's first fill takes hundreds of jobs at once)."""
        n = 0
        for (band, tenant), served in self.served.items():
            if served[0]:
                for sibling in (b for b in self.siblings_of(band) if b != band):
                    pipe.zadd(Keys.fair_backlog(sibling), {tenant: served[0]}, xx=True, incr=True)
                    n += 1
                served[0] = 0.0
        self.charged_here = False
        return n

    def siblings_of(self, band: str) -> tuple[str, ...]:
        """The band (one model's shared stream of one priority) in every shard we serve, shard by shard: on one
        Redis, the band alone."""
        if band not in self.siblings:
            part = self.keys.of_stream(band)
            suffix = band[len(part.prefix):]
            self.siblings[band] = tuple(b for p in self.keys.parts
                                        if (b := p.prefix + suffix) == band or b in self.bands)
        return self.siblings[band]

    def sweep(self, min_idle_ms: int, consumer: str) -> Swept:
        """Delete the tenants' streams left empty and the departed consumers of the others, a bounded slice of each
        band's streams index per call (SWEEP_LUA): one script per shard, whatever the tenants."""
        if self.script is None:
            self.script = self.client.register_script(SWEEP_LUA)
        prefix = "" if self.keys.cluster else self.keys.worker("")
        deleted, gone, more = 0, set(), False
        for bands in self.keys.by_shard(sorted(self.bands)):
            keys = [k for band in bands
                    for k in (Keys.fair_streams(band), Keys.fair_backlog(band), Keys.fair_pending(band))]
            args = [Keys.GROUP, min_idle_ms, prefix, consumer, SWEEP_TENANTS, *bands]
            n, names, full = run_script(self.script, keys, args, self.client)
            deleted, more = deleted + int(n), more or bool(full)
            gone |= {as_text(name) for name in names}
        return Swept(deleted, sorted(gone), more)

    def band_of(self, stream: str) -> str | None:
        band, sep, _ = stream.rpartition(":t:")  # tenant names hold no ':'
        return band if sep and band in self.bands else None

    def band_of_job(self, stream: str) -> str:
        """The band a job read from this stream counts in for shares of a worker's jobs (Occupancy): its tenant's
        band, else the stream itself; on a Redis Cluster a band's first shard stands for it in every shard, so a job
        of one shard may make room among the jobs a worker read from the others."""
        band = self.band_of(stream) or stream
        return self.siblings_of(band)[0] if band in self.bands else band

    def write_weights(self, weights: dict[str, float]) -> None:
        """A weights file's tenants become the namespace's `{ns}:tenants`, replacing it in one step, so every
        worker (with the file or without) reads the same weights with its next heartbeat."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.tenants())
        if weights:
            pipe.hset(self.keys.tenants(), mapping={t: repr(w) for t, w in weights.items()})
        pipe.execute()
        log.info("tenant weights from the file: %s", ", ".join(f"{t}={w:g}" for t, w in weights.items()) or "none")

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
        self.weights, odd = parse_weights(replies[1])
        if odd != self.odd_weights:  # once per change, not every heartbeat
            self.odd_weights = odd
            if odd:
                log.warning("tenant weights in %s taken otherwise than they read (a weight is %s; one that is no "
                            "positive number counts as 1): %s; set them within the range", self.keys.tenants(),
                            RANGE, ", ".join(f"{t}={v}" for t, v in odd.items()))
        if self.active != was:
            log.info("fair share across tenants %s", "on" if self.active else "off")

    def _card(self, band: str) -> int:
        return self.client.zcard(Keys.fair_backlog(band))


@dataclass(slots=True)
class Occupancy:
    """The jobs a worker runs now in one band (on a Redis Cluster, its jobs of that model and priority from every
    shard: Fair.band_of_job; not those stepped aside), by tenant, and who holds more than a share of them. A
    tenant's share, for one more of some tenant's jobs: the jobs running plus that one, times its weight over the
    weights of the tenants running (counting that one), so a tenant of weight 2 beside one of weight 1 holds two
    thirds before it gives way.
    Its job may make room when it stays within that share (`room`), and only tenants at or above it give way: a
    backlogged tenant's jobs (read from a backlog, not few: Entry.may_preempt unset) once it holds its share, a
    tenant with few jobs waiting only above it. So a job that made room never gives it back to the jobs it
    displaced, and between tenants with few jobs waiting at their share nothing moves. Shares count jobs: the ones
    that step aside are as many as the job needs, the youngest first."""

    counts: dict[str, int] = field(default_factory=dict)
    backlogged: set[str] = field(default_factory=set)  # tenants running a job here read from their backlog
    weights: dict[str, float] = field(default_factory=dict)  # Fair.weights: the tenants whose weight is not 1

    def add(self, tenant: str, backlogged: bool) -> None:
        self.counts[tenant] = self.counts.get(tenant, 0) + 1
        if backlogged:
            self.backlogged.add(tenant)

    def weight(self, tenant: str | None) -> float:
        """Within the range whatever `weights` holds, so the shares' sum of weights is 0.001 at least and a share
        (jobs + 1) * 1e6 at most: `room`'s floor never meets inf or nan (tenant_weights.py)."""
        return 1.0 if tenant is None else clamp_weight(self.weights.get(tenant, 1.0))

    def per_weight(self, tenant: str | None = None) -> float:
        """The jobs here once one more of `tenant`'s runs, per unit of the weights of the tenants running (counting
        it; None: a tenant not running here, of weight 1)."""
        return (sum(self.counts.values()) + 1) / sum(self.weight(t) for t in {*self.counts, tenant})

    def share(self, tenant: str | None = None, of: str | None = None) -> float:
        """`of`'s share (by default `tenant`'s) of the jobs here once one more of `tenant`'s runs."""
        return self.per_weight(tenant) * self.weight(tenant if of is None else of)

    def room(self, tenant: str | None = None) -> int:
        """How many more of its jobs could run here within its share (None: a tenant not running here)."""
        return math.floor(self.share(tenant)) - self.counts.get(tenant, 0)

    def over(self, tenant: str | None = None) -> tuple[str, ...]:
        """The tenants other than this one whose jobs may step aside for one more of its jobs."""
        per_weight = self.per_weight(tenant)
        return tuple(t for t, n in self.counts.items() if t != tenant and
                     (n > (share := per_weight * self.weight(t)) or (t in self.backlogged and n >= share)))

    def makes_room(self, tenant: str | None = None) -> bool:
        """Whether a job of this tenant (None: one not running here) may make room here: it stays within its share,
        and some other tenant gives way."""
        return self.room(tenant) > 0 and bool(self.over(tenant))
