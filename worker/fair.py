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
exist sit in `<band>:fair:streams`, which the pruning pass (`Fair.sweep`, worker/fair_sweep.py) walks a bounded slice at a
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

from kvgate.producer.keys import Keys
from kvgate.worker.fair_sweep import Swept, Sweeper
from kvgate.worker.named import Named
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


# The read script's part (worker/reader.py READ_LUA, its locals there; `input.shares`: shares_read_inputs, and per band
# stream `stream.tenants`: tenants_read_inputs). The band's backlogged tenants, lowest virtual token counter first. A tenant
# is charged `charge` tokens per job over its weight when read; one newly backlogged (producers add it at -inf) is
# placed at the band's virtual time, the counter last served, or at the lowest counter of the tenants backlogged if
# that is higher (on a cluster workers add what tenants took in the other shards to this shard's counters, which
# moves no virtual time here): no credit for the time it was idle. Taken from the lowest up to the point where it
# would pass the next one (QUANTUM jobs at least). Each turn takes a job or drops a tenant, at most 64 turns: a read
# costs the same with 3 tenants or 100,000.
# A job may make room for itself on a full worker only when its tenant had at most PREEMPT_BACKLOG jobs waiting, all
# of them read (a long backlog's wait is its own doing, and backlogged tenants share by counters): such entries are
# marked `few`; `alone`: its tenant was the only one backlogged in the band (Fair.read). A full worker's preempting
# look (preempt_ms > 0) reads at most one job, in the first band (by priority) with backlogged tenants, and only if
# the worker gave that band rooms: of the PREEMPT_LOOK lowest counters, the first tenant whose job may make room there
# with at most PREEMPT_BACKLOG jobs waiting, the next of which has waited preempt_ms. A reclaim also looks at the
# tenants' streams read more than min idle ago (`<band>:fair:pending`), which may hold a dead worker's entries.
# A tenant's jobs are taken by deadline order (due.py's `take`, with the tenant's own window and index): the counters
# pick the tenant, its earliest due job goes first; its parked jobs count as waiting for the preempting look.
TENANTS_READ_LUA = """
local fair = input.shares or {}
local charge, weights = math.max(fair.charge or 1, 1), fair.weights or {}
local QUANTUM = 4  -- jobs a turn may take past the next counter: fewer turns per job, shares off by 4 jobs at most
local PREEMPT_LOOK, PREEMPT_BACKLOG = 4, 32
local function weight(tenant) return math.max(tonumber(weights[tenant]) or 1, 0.001) end
local function tenant_orphans(stream)  -- a reclaim: the band's tenants' streams read more than min_idle ago
  local pending = KEYS[stream.tenants.pending]
  for _, tenant in ipairs(redis.call('ZRANGEBYSCORE', pending, '-inf', now - min_idle, 'LIMIT', 0, 64)) do
    if want <= 0 then break end
    local key = KEYS[stream.key] .. ':t:' .. tenant
    local left = redis.pcall('XPENDING', key, group)
    if type(left) ~= 'table' or left.err or left[1] == 0 then
      redis.call('ZREM', pending, tenant)
    else
      local mine = orphans(key)
      if #mine > 0 then table.insert(out, {'stream', key, 'taken', mine}) end
      redis.call('ZADD', pending, now, tenant)  -- looked at: again once min_idle has passed
    end
  end
end
local function waited(key, cutoff)  -- a few new or parked entries only, the next at least as old as the cutoff?
  local ok, last = pcall(delivered, key)  -- no stream: nothing waits; no group yet: every entry is new
  if not ok then return false end
  local next = redis.call('XRANGE', key, '(' .. (last or '0-0'), '+', 'COUNT', PREEMPT_BACKLOG + 1)
  local index = index_for(key)  -- deadline order (due.py): the earliest due parked one goes next
  local parked = index and redis.call('ZRANGE', index, 0, 0) or {}
  local first = parked[1] and unpad(parked[1]) or (next[1] and next[1][1])
  local n = #next + (parked[1] and redis.call('ZCARD', index) or 0)
  return first ~= nil and n <= PREEMPT_BACKLOG and tonumber(string.match(first, '^(%d+)')) <= cutoff
end
local function drained(key, entries)  -- nothing new nor parked left after these?
  local index = index_for(key)
  if index and redis.call('EXISTS', index) == 1 then return false end
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1][1]
  for _, e in ipairs(entries) do
    if e[1] == last then return true end
  end
  return false
end
local function tenant_take(key, n)  -- by deadline order (due.py); producers leave groups to the first reader
  local ok, entries = pcall(take, key, n)
  if not ok and string.find(type(entries) == 'table' and tostring(entries.err) or tostring(entries), 'NOGROUP') then
    redis.pcall('XGROUP', 'CREATE', key, group, '0')  -- no stream: nothing to read
    ok, entries = pcall(take, key, n)
  end
  return ok and entries or {}
end
local looked = false  -- a preempting look is over once a band with backlogged tenants was seen
-- A read's bands of one priority (a kin: the base model's, its other names' and its LoRA adapters', all run by one
-- engine) are served together: each turn takes from the lowest counter of any of them, and a tenant's counters in
-- every band of its kin (`tenants.also`: those this read leaves out, adapters without room here) move together, so
-- naming another model or an adapter (its own streams) is no way around the shares.
local kins = {}
for _, stream in ipairs(streams) do
  if stream.tenants then
    local name = stream.tenants.kin or ('#' .. stream.key)
    kins[name] = kins[name] or {bands = {}, backlogs = {}}
    local kin = kins[name]
    table.insert(kin.bands, stream)
    table.insert(kin.backlogs, KEYS[stream.tenants.backlog])
    for _, index in ipairs(stream.tenants.also or {}) do table.insert(kin.backlogs, KEYS[index]) end
  end
end
local function tenants_take(stream)
  local kin = kins[stream.tenants.kin or ('#' .. stream.key)]
  if kin.bands[1] ~= stream then return end  -- read with the first band of its kin
  local bands, vt = {}, 0
  for i, s in ipairs(kin.bands) do
    local b = {key = KEYS[s.key], backlog = KEYS[s.tenants.backlog], pending = KEYS[s.tenants.pending],
               rooms = s.tenants.rooms}
    vt = math.max(vt, tonumber(redis.call('GET', b.backlog .. ':vt') or 0) or 0)
    bands[i] = b
  end
  local served_at = nil  -- the lowest counter served: where newcomers start
  local floor, placed = nil, {}
  local function counter(tenant, raw)  -- a score of -inf: newly backlogged, placed where the others are (below)
    if raw ~= '-inf' then return tonumber(raw) end
    if placed[tenant] then return placed[tenant] end
    if not floor then  -- the kin's virtual time, or the lowest counter of the tenants backlogged if that is higher
      local lowest = nil
      for _, backlog in ipairs(kin.backlogs) do
        local low = redis.call('ZRANGEBYSCORE', backlog, '(-inf', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
        if #low > 0 then lowest = math.min(lowest or tonumber(low[2]), tonumber(low[2])) end
      end
      floor = math.max(vt, lowest or vt)
    end
    local own = floor  -- and no lower than its own counter in the kin's other bands
    for _, backlog in ipairs(kin.backlogs) do
      local raw = redis.call('ZSCORE', backlog, tenant)
      local score = raw and raw ~= '-inf' and tonumber(raw)
      if score and score > own then own = score end
    end
    placed[tenant] = own
    return own
  end
  local function serve(b, tenant, score, n, few, alone)  -- read up to n of its jobs, charge it, drop it once it has none
    local key = b.key .. ':t:' .. tenant
    local entries = tenant_take(key, n)  -- counted off `want`
    if #entries > 0 then
      few = few or (#entries <= PREEMPT_BACKLOG and (#entries < n or drained(key, entries)))
      table.insert(out, {'stream', key, 'new', entries, 'few', few and 1 or 0, 'alone', alone and 1 or 0})
      if redis.call('DECRBY', b.backlog .. ':queued', #entries) < 0 then redis.call('SET', b.backlog .. ':queued', 0) end
      redis.call('ZADD', b.pending, 'NX', now, tenant)
      served_at, placed[tenant] = score, nil
      local charged = #entries * charge / weight(tenant)
      for _, backlog in ipairs(kin.backlogs) do  -- one counter per tenant across the kin
        if backlog ~= b.backlog then redis.call('ZADD', backlog, 'XX', 'INCR', charged, tenant) end
      end
    end
    if #entries < n then  -- no more new entries (or not a stream we can read): not backlogged now
      redis.call('ZREM', b.backlog, tenant)
    else
      redis.call('ZADD', b.backlog, score + #entries * charge / weight(tenant), tenant)
    end
  end
  if preempt_ms > 0 then
    for _, b in ipairs(bands) do
      local low = redis.call('ZRANGE', b.backlog, 0, PREEMPT_LOOK - 1, 'WITHSCORES')
      looked = looked or #low > 0
      local found = false
      for i = 1, #low, 2 do
        if not b.rooms then break end
        if (b.rooms[low[i]] or b.rooms['']) > 0 and waited(b.key .. ':t:' .. low[i], now - preempt_ms) then
          serve(b, low[i], counter(low[i], low[i + 1]), 1, true, #low == 2)
          found = true
          break
        end
      end
      if found then break end
    end
  else
    local turns = 0
    while want > 0 and turns < 64 do
      turns = turns + 1
      local lows = {}  -- each band's two lowest: the kin's lowest, and the next other tenant's
      for i, b in ipairs(bands) do
        local low = redis.call('ZRANGE', b.backlog, 0, 1, 'WITHSCORES')
        for j = 1, #low, 2 do
          table.insert(lows, {b = b, order = i, tenant = low[j], score = counter(low[j], low[j + 1]),
                              fresh = low[j + 1] == '-inf'})
        end
      end
      if #lows == 0 then break end
      table.sort(lows, function(x, y)
        if x.score ~= y.score then return x.score < y.score end
        if x.fresh ~= y.fresh then return x.fresh end  -- as a band's order has it: a newcomer first
        if x.tenant ~= y.tenant then return x.tenant < y.tenant end
        return x.order < y.order
      end)
      local first, second = lows[1], nil
      for _, c in ipairs(lows) do
        if c.tenant ~= first.tenant then second = c break end
      end
      local n = want
      if second then
        local gap = (second.score - first.score) * weight(first.tenant) / charge
        n = math.min(want, math.max(QUANTUM, math.floor(gap) + 1))
      end
      serve(first.b, first.tenant, first.score, n, false, second == nil)
    end
  end
  if served_at and served_at ~= vt then
    for _, backlog in ipairs(kin.backlogs) do redis.call('SET', backlog .. ':vt', tostring(served_at)) end
  end
end
local function bands_queued()  -- each band's jobs still queued after this read: band, count, band, count...
  local queued = {}
  for _, stream in ipairs(streams) do
    if stream.tenants then
      queued[#queued + 1] = KEYS[stream.key]
      local n = redis.call('GET', KEYS[stream.tenants.backlog] .. ':queued')
      queued[#queued + 1] = math.max(tonumber(n or 0) or 0, 0)
    end
  end
  return queued
end
"""


def shares_read_inputs(charge: float, preempt_ms: int, weights: dict[str, float]) -> dict:
    """The read script's fair share inputs (TENANTS_READ_LUA's `input.shares`)."""
    return {"charge": charge, "preempt_ms": preempt_ms, "weights": weights}


def kin_of(band: str) -> str:
    """The name of a band's kin in a read: the bands of its priority in its shard (`<shard prefix>:jobs:<model>:
    <priority>`, Keys.jobs), whatever their model: the base model's names and its LoRA adapters run on one engine."""
    return f"{band.partition(':jobs:')[0]}|{Keys.band_priority(band)}"


def tenants_read_inputs(band: str, here: Occupancy | None, add_key, also: list[str] = ()) -> dict:
    """A band stream's part of the read script's inputs (its `stream.tenants`): its backlog and pending index, added to
    the script's KEYS by `add_key` (which returns the index), and its kin (`kin_of`); `also`: the bands of its kin this
    read leaves out, whose counters move with the others'; with `here` (a preempting look: what the worker runs in
    the band), per tenant running there ('' for any other) 1 if a job of it may make room there, else 0."""
    out = {"backlog": add_key(Keys.fair_backlog(band)), "pending": add_key(Keys.fair_pending(band)),
           "kin": kin_of(band)}
    if also:
        out["also"] = [add_key(Keys.fair_backlog(b)) for b in also]
    if here is not None:
        out["rooms"] = {t or "": int(here.makes_room(t)) for t in (None, *here.counts)}
    return out


def tenant_of(stream: str, band: str) -> str:
    """The tenant whose stream in `band` this is (Keys.tenant_jobs)."""
    return stream.removeprefix(Keys.tenant_jobs(band, ""))


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
    sweeper: Sweeper | None = None  # the pruning pass's (worker/fair_sweep.py), made at its first use
    backlogs: list[list[str]] = field(default_factory=list)  # the bands' backlog keys shard by shard (sync's look)
    backlogs_of: int = -1  # how many bands those keys were named for

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
                delta = corrected + (charged if self._elsewhere(sibling, band) else 0.0)
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
                for sibling in (b for b in self.siblings_of(band) if self._elsewhere(b, band)):
                    pipe.zadd(Keys.fair_backlog(sibling), {tenant: served[0]}, xx=True, incr=True)
                    n += 1
                served[0] = 0.0
        self.charged_here = False
        return n

    def siblings_of(self, band: str) -> tuple[str, ...]:
        """The bands whose counters move with this one's (the band among them), in one order whichever asks, so the
        first stands for them all (band_of_job): the bands of its priority we serve, of every model (the base model's
        names and its LoRA adapters: one engine runs them, so a tenant has one counter and one share across them,
        and naming an adapter is no way around it) and in every shard."""
        if band not in self.siblings:
            priority = Keys.band_priority(band)
            self.siblings[band] = tuple(sorted({band, *(b for b in self.bands if Keys.band_priority(b) == priority)}))
        return self.siblings[band]

    def _elsewhere(self, band: str, read_in: str) -> bool:
        """Whether a read in `read_in` left `band`'s counters to us: a read charges its whole kin in its own shard."""
        return self.keys.of_stream(band).shard != self.keys.of_stream(read_in).shard

    def add_bands(self, bands: list[str]) -> None:
        """Bands of models we serve from now on (LoRA adapters registered since we started)."""
        if not set(bands) <= self.bands:
            self.bands |= set(bands)
            self.siblings = {}

    def sweep(self, min_idle_ms: int, consumer: str) -> Swept:
        """One pruning pass over our bands' tenants' streams (worker/fair_sweep.py)."""
        if self.sweeper is None:
            self.sweeper = Sweeper(self.client, self.keys)
        return self.sweeper.sweep(self.bands, min_idle_ms, consumer)

    def prune(self, min_idle_ms: int, consumer: str) -> bool:
        """A pruning pass, what it deleted logged; whether more may be due now (a drain empties every tenant's stream
        at once: the next pass then comes SWEEP_AGAIN_S later, not a trim interval)."""
        swept = self.sweep(min_idle_ms, consumer)
        if swept.consumers:
            log.info("deleted %d departed consumers of tenants' streams: %s", len(swept.consumers),
                     ", ".join(swept.consumers))
        if swept.deleted:
            log.info("deleted %d tenants' streams left empty", swept.deleted)
        return swept.more

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
        named = Named(self.client.pipeline(transaction=False))
        if self.setting == "on":
            named.on("set").set(self.keys.fair(), int(time.time()))
        elif self.setting == "off":
            named.on("set").delete(self.keys.fair())
        named.on("on").exists(self.keys.fair())
        named.on("weights").hgetall(self.keys.tenants())
        replies = named.execute()
        backlogged = not replies["on"] and self._any_backlogged()
        was = self.active
        self.on, self.active = bool(replies["on"]), bool(replies["on"]) or backlogged
        self.weights, odd = parse_weights(replies["weights"])
        if odd != self.odd_weights:  # once per change, not every heartbeat
            self.odd_weights = odd
            if odd:
                log.warning("tenant weights in %s taken otherwise than they read (a weight is %s; one that is no "
                            "positive number counts as 1): %s; set them within the range", self.keys.tenants(),
                            RANGE, ", ".join(f"{t}={v}" for t, v in odd.items()))
        if self.active != was:
            log.info("fair share across tenants %s", "on" if self.active else "off")

    def _any_backlogged(self) -> bool:
        """Whether any band's backlog still holds a tenant (a backlog is deleted with its last one): one EXISTS a
        shard over every band. A ZCARD a band, one round trip each, cost a fleet serving 200 LoRA adapters (600 bands)
        600 round trips a heartbeat on every worker's loop: W-LORA's fleet ran at a third of its jobs/s with no fair
        share and no adapter job at all."""
        if self.backlogs_of != len(self.bands):  # bands only join (add_bands): their keys named once per change
            self.backlogs = [[Keys.fair_backlog(b) for b in group] for group in self.keys.by_shard(sorted(self.bands))]
            self.backlogs_of = len(self.bands)
        return any(self.client.exists(*group) for group in self.backlogs if group)


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
