"""Refill: how many jobs to read from Redis and from which streams, sized by one look at the engine's room.

A busy engine is refilled in each step's round trip (`request`, `queue`, `took`); an idle one reads at once
and then waits on a blocking read (`read_idle`, `read_blocking`); entries already pending to us (a restart
under the same id, a lost reply) are read first of all (`read_own_pending`). What was read goes back to the
worker as entries; turning them into jobs is the intake's."""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import redis

from kvgate.engine.outputs import Admission
from kvgate.producer.keys import Keys, as_text
from kvgate.worker.adapters import ModelsToRead
from kvgate.worker.admission import AdmissionQueue
from kvgate.worker.affinity import Affinity, Lane
from kvgate.worker.clock import ServerClock, entry_ms
from kvgate.worker.engine import Engine
from kvgate.worker.fair import FAIR_BLOCK_MS, Fair, Occupancy
from kvgate.worker.hand_back import grace_ms
from kvgate.worker.lane_prefixes import LanePrefixes
from kvgate.worker.leases import Leases
from kvgate.worker.read_plan import ReadPlan
from kvgate.worker.read_reply import Entry
from kvgate.worker.reader import Reader, ReadSlot
from kvgate.worker.named import Named
from kvgate.worker.slots import FullOwners, Ignored
from kvgate.worker.settings import WorkerSettings

log = logging.getLogger("kvgate.worker")
PREEMPT_LOOK_EVERY = 2  # a full worker's preempting look, about every this many fair_preempt_ms (jittered)
TENANT_STREAMS = 256  # tenants' streams a rewind looks at again: what a lost reply may have delivered is in the last few
CLUSTER_BLOCK_MS = 100  # a blocking read waits on one shard of a cluster; then the next look covers them all


@dataclass(slots=True)
class Capacity:
    """The engine's room at one moment, asked of it once and only when something needs it: the step's round
    trip spends it on what it tells the other workers and on the refill read."""

    engine: Engine
    seen: Admission | None = None
    jobs: int | None = None  # whole jobs the room takes, once asked

    def now(self) -> Admission:
        if self.seen is None:
            self.seen = self.engine.admission()
        return self.seen

    def readable(self, queue: AdmissionQueue) -> int:
        """How many whole jobs to read now, the jobs already waiting here counted against the room: one answer per
        step, for what the worker tells the others (has_room) and for what it reads (request)."""
        if self.jobs is None:
            adm = self.now()
            self.jobs = queue.read_count(adm.free_seqs, adm.admissible_tokens, False)
        return self.jobs


@dataclass(slots=True)
class ReadRequest:
    """The jobs one round trip reads: `count` whole jobs, and besides them `held` jobs of `lanes` whose prefix
    running sequences hold (read as tails, in the room the whole jobs leave)."""

    count: int = 0
    lanes: list[Lane] = field(default_factory=list)
    held: int = 0
    reclaim_ms: int = 0  # >0: take over entries idle this long (dead workers') before new ones
    preempt: dict[str, Occupancy] = field(default_factory=dict)  # fair share, full: the preempting look's bands

    def __bool__(self) -> bool:
        return bool(self.count or self.held or self.preempt)


@dataclass(slots=True)
class QueuedReads:
    """The reads of a request on their way: the held lanes' read (its reply first), the refill read, and who is
    full now (for the next plan)."""

    request: ReadRequest
    held: ReadSlot | None
    new: ReadSlot | None
    full: FullOwners

    def take(self, replies: Iterator) -> None:
        for slot in (self.held, self.new, self.full):
            if slot is not None:
                slot.take(replies)


class Refill:
    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, streams: list[str], settings: WorkerSettings,
                 engine: Engine, queue: AdmissionQueue, affinity: Affinity, lane_prefixes: LanePrefixes,
                 leases: Leases, clock: ServerClock, metrics: Any, per_priority: int, fair: Fair | None = None,
                 models_now: ModelsToRead | None = None,
                 occupancy: Callable[[], dict[str, Occupancy]] = dict) -> None:
        self.client, self.keys, self.worker_id, self.settings = client, keys, worker_id, settings
        self.engine, self.queue, self.affinity, self.lane_prefixes = engine, queue, affinity, lane_prefixes
        self.leases, self.clock, self.metrics = leases, clock, metrics
        self.fair = fair if fair is not None else Fair(client, keys, "keep")
        self.reader = Reader(client, worker_id, ReadPlan(list(streams)), per_priority,
                             steal_age_ms=settings.affinity_steal_age_ms, keys=keys,
                             handed_grace_ms=grace_ms(settings.hand_back_ms), deadline_window=settings.read_window)
        self.cursors: dict[str, str | None] = {st: "0" for st in streams}  # own pending first, then ">"
        self.reclaim_due = False  # the next read takes over dead workers' entries before new ones
        self.held_dry_until = 0.0  # a read of the lanes whose prefix we hold found none: no such read till then
        self.last_read_empty_at = 0.0
        self.empty_reads = 0  # consecutive empty refill reads: back off while the backlog stays empty
        self.block_turn = 0  # on a cluster: the shard the next blocking read waits on
        self.backlog_seen_at = -1  # fair share: empty_reads when a wait last found a band's backlog (-1: none)
        self.tenant_streams: dict[str, None] = {}  # fair share: tenants' streams we read lately, oldest first
        self.preempt_look_at = 0.0  # fair share, full: the next preempting look, not before
        self.occupancy = occupancy  # fair share: the jobs we run by band and tenant
        self.models_now = models_now  # without lanes: the model names a read looks at (None: all we serve)

    def use_queue(self, queue: AdmissionQueue) -> None:
        self.queue = queue  # the local queue whose room and estimates size our reads

    @property
    def script(self) -> object:
        """The read script, to load again where a cluster primary lost it."""
        return self.reader.script

    # ---- what is pending to us ----------------------------------------------------------------------
    @property
    def own_pending(self) -> bool:
        return any(c is not None for c in self.cursors.values())

    def rewind(self, streams: list[str]) -> None:
        """Read our own pending entries again first: a lost reply (or a refused pipeline) may have delivered some,
        also in the tenants' streams we read lately (fair share)."""
        self.cursors = {st: "0" for st in [*streams, *self.tenant_streams]}

    def add_streams(self, streams: list[str]) -> None:
        self.cursors.update({st: "0" for st in streams})  # a restarted worker of the same id may hold entries there

    def reclaim_soon(self) -> None:
        self.reclaim_due = True

    def read_own_pending(self, count: int, holds: Callable[[str, str], bool]) -> list[list[Entry]]:
        """Entries already pending to us: every stream in one round trip (with lanes there are hundreds), at
        most `count` taken; a stream cut short keeps its cursor. Stream by stream, those we do not hold yet."""
        cursors = {st: c for st, c in self.cursors.items() if c is not None}
        found = {}
        for group in self.keys.by_shard(list(cursors)):  # one slot per command on a cluster
            found |= {as_text(st): entries for st, entries in self._pending_in(group, cursors, count)}
        batches = []
        for stream in cursors:
            entries = [(as_text(i), f) for i, f in found.get(stream, [])][:count]
            self.cursors[stream] = entries[-1][0] if entries else None
            fresh = [(i, f) for i, f in entries if not holds(stream, i)]
            if entries:
                deliveries = self.leases.count_delivery(stream, [i for i, _ in fresh],
                                                        [i for i, _ in entries if holds(stream, i)])
                if fresh:
                    batches.append([Entry(stream, i, f, n) for (i, f), n in zip(fresh, deliveries)])
            count -= len(entries)
            if count <= 0:
                break
        return batches

    def _pending_in(self, streams: list[str], cursors: dict[str, str], count: int) -> list:
        """One XREADGROUP over the streams; where one has no group (a tenant's stream the pruning pass deleted once
        it was empty: nothing of ours was pending there), stream by stream, those without one giving nothing."""
        try:
            return self.client.xreadgroup(Keys.GROUP, self.worker_id, {st: cursors[st] for st in streams},
                                          count=count) or []
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            if len(streams) == 1:
                return []
            return [row for st in streams for row in self._pending_in([st], cursors, count)]

    # ---- an idle engine ------------------------------------------------------------------------------
    def read_idle(self, count: int) -> list[Entry]:
        """An idle engine's look (a busy one reads in the step's round trip): it can afford every lane."""
        reclaim_ms = self._reclaim_ms()
        entries = self.reader.read(count, self._plan(reclaim_ms, full=True), reclaim_ms)  # a cluster: shard by shard
        if not entries and self.models_now is not None and self.models_now.look_again():  # LoRA adapters' jobs wait
            entries = self.reader.read(count, self._plan(0, full=True))
        if self.affinity.enabled and self.affinity.lanes:
            pipe = self.client.pipeline(transaction=False)
            slots = (Ignored(self.affinity.tell(pipe, room=True)), FullOwners(self.affinity, self.affinity.look(pipe)))
            replies = iter(pipe.execute())
            for slot in slots:
                slot.take(replies)
        got = self.took(entries, count, reclaim_ms, len(entries) < count)
        if self.fair.charged_here:  # on a cluster: onto the other shards' counters before the step that runs them
            self.fair.flush()
        return got

    def read_blocking(self, count: int) -> list[Entry]:
        """Wait for the next job (with lanes: on the shared streams, our own lanes and those nobody owns). COUNT 1
        per stream, on at most `count` streams: one entry per stream could arrive at once, and more than `count`
        would break the local queue's bound. Where more streams are ours to wait on, the wait only wakes us
        (_wait_for_new) and the next read takes: left out of a wait, a lane nobody else waits on (a model that only
        workers without affinity serve) held its jobs for a whole blocking timeout (issue 45)."""
        r = self.reader
        # with lanes, also on the lanes of owners that said they are full: their jobs are ours to take at once
        home = self.affinity.home() + r.plan.urgent_streams() if self.affinity.lanes else r.order()
        shards = self.keys.by_shard(home)  # on a cluster: wait on one shard, the next one each time
        self.block_turn += 1
        shard = shards[self.block_turn % len(shards)]
        if self.fair.active:
            self._wait_for_bells(shard[:count])
            return []
        if len(shard) > count:
            self._wait_for_new(shard)
            return []
        streams = {st: ">" for st in shard}
        reply = self.client.xreadgroup(Keys.GROUP, self.worker_id, streams, count=1, block=self._block_ms())
        return [Entry(as_text(st), as_text(i), f, 1) for st, entries in reply or [] for i, f in entries]

    def _wait_for_new(self, streams: list[str]) -> None:
        """Wait, taking nothing, for an entry no worker has taken in any of the streams (one shard's): XREAD past
        each one's last delivered id (read first, in one round trip), so one that came before the wait wakes it at
        once."""
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        ids = {st: _delivered(groups) for st, groups in zip(streams, pipe.execute(raise_on_error=False))}
        self.client.xread(ids, count=1, block=self._block_ms())

    def _wait_for_bells(self, streams: list[str]) -> None:
        """Fair share: a blocking read cannot wait on a band's backlog (a sorted set) nor take a tenant's jobs by
        their counters, so the wait only wakes us, and the next read takes. It waits (XREAD, one shard) on these
        shared streams past their group's last delivered entry (an entry no worker took yet wakes it at once) and on
        the shard's bands' bells past the last ring we saw, which a producer rings when a tenant joins a band's
        backlog. Their ids and the backlogs' sizes are read first, in one round trip: a tenant that joined before
        that look is in a backlog, one that joins after rings past the id we wait from. A backlog is read again at
        once, and if it is still there after that read (a race with another worker's), waited on for FAIR_BLOCK_MS
        at most."""
        shard = self.keys.of_stream(streams[0]).shard
        bands = [b for b in sorted(self.fair.bands) if self.keys.of_stream(b).shard == shard]
        named = Named(self.client.pipeline(transaction=False))
        for stream in streams:
            named.on(("groups", stream)).xinfo_groups(stream)
        for band in bands:
            named.on(("backlog", band)).zcard(Keys.fair_backlog(band))
            named.on(("bell", band)).xrevrange(Keys.fair_bell(band), count=1)
        replies = named.execute(raise_on_error=False)
        ids = {st: _delivered(replies["groups", st]) for st in streams}
        backlogged = any(isinstance(n := replies["backlog", b], int) and n > 0 for b in bands)
        for band in bands:
            rung = replies["bell", band]
            ids[Keys.fair_bell(band)] = as_text(rung[0][0]) if rung and not isinstance(rung, Exception) else "0-0"
        if backlogged and self.empty_reads != self.backlog_seen_at + 1:  # not re-read since we saw it: read now
            self.backlog_seen_at = self.empty_reads
            return
        self.backlog_seen_at = self.empty_reads if backlogged else -1
        self.client.xread(ids, count=1, block=min(self._block_ms(), FAIR_BLOCK_MS) if backlogged else self._block_ms())

    def _block_ms(self) -> int:
        """With lanes an idle worker wakes once per steal age to look at others' lanes (it blocks on its own)."""
        block_ms = self.settings.block_ms
        if len(self.keys.parts) > 1:  # a wait covers one shard: come back soon to look at the others
            block_ms = min(block_ms, CLUSTER_BLOCK_MS)
        if self.affinity.enabled and self.affinity.lanes and self.settings.affinity_steal_age_ms:
            return max(1, min(block_ms, self.settings.affinity_steal_age_ms))
        return block_ms

    # ---- a busy engine: in the step's round trip -----------------------------------------------------
    def has_room(self, capacity: Capacity, draining: bool) -> bool:
        """Whether a job of our lanes could start now; told to the others (Affinity.tell). Jobs just read wait in
        the local queue until the next admission pass: they count against the room, not as a sign of being full."""
        if draining:
            return False
        if not self.engine.has_unfinished() and not self.queue.tickets:
            return True
        return capacity.readable(self.queue) > 0

    def request(self, capacity: Capacity, draining: bool) -> ReadRequest:
        """Jobs to read in this step's round trip, and besides them, lanes whose prefix we hold with how many of
        their jobs fit in the room those leave (_held_lanes)."""
        # an idle engine reads on its own (Worker._intake), unless jobs wait here: for their LoRA adapter's read
        if draining or not (self.engine.has_unfinished() or self.queue.tickets) or self.own_pending:
            return ReadRequest()
        wait_s = self.settings.busy_poll_ms / 1000 * 2 ** min(self.empty_reads, 3)
        if self.affinity.owned_count:  # look at our lanes at least once per steal age: their jobs wait for us that long
            wait_s = min(wait_s, self.settings.affinity_steal_age_ms / 1000)
        if time.monotonic() - self.last_read_empty_at < wait_s:
            return ReadRequest()
        count = capacity.readable(self.queue)
        lanes, held = self._held_lanes(count, capacity.now())
        if not (count or held):
            return ReadRequest(preempt=self._preempt_look_due())
        return ReadRequest(count, lanes, held, self._reclaim_ms() if count else 0)

    def _preempt_look_due(self) -> dict[str, Occupancy]:
        """Full, with fair share: the bands in which to look for a job of a tenant under its share here that
        waited fair_preempt_ms (it makes room for itself: Room.make), with what we run in each: those where
        tenants are over their share. Only while no job we read waits here for room (one at a time: the jobs that
        stepped aside wait in the engine, and do not stop it), and about every PREEMPT_LOOK_EVERY fair_preempt_ms,
        jittered: any full worker's look may take such a job, so a fleet of n full workers looks n times as often, and
        one look per step each cost a flood alone 4-5% of its jobs/s."""
        if not (self.fair.active and self.settings.fair_preempt_ms) or self.queue.tickets:
            return {}
        now = time.monotonic()
        if now < self.preempt_look_at:
            return {}
        every = PREEMPT_LOOK_EVERY * self.settings.fair_preempt_ms / 1000
        self.preempt_look_at = now + random.uniform(0.5 * every, 1.5 * every)
        return {band: here for band, here in self.occupancy().items() if band in self.fair.bands and here.over()}

    def _held_lanes(self, count: int, adm: Admission) -> tuple[list[Lane], int]:
        """Lanes whose prefix running sequences hold, and how many of their jobs fit as tails in the room that
        `count` whole jobs leave: read apart from those, so they never claim room the whole-job read counts on. None
        while a job waits here (as for steals: a job read should start now)."""
        if not (self.affinity.enabled and self.affinity.lanes) or self.queue.tickets or count >= adm.free_seqs:
            return [], 0
        room = adm.admissible_tokens - count * max(self.queue.tokens_per_job, 1.0)
        cheapest = self.lane_prefixes.cheapest()
        if cheapest is None or room < cheapest or time.monotonic() < self.held_dry_until:
            return [], 0
        held = self.lane_prefixes.held(self.engine.shared_prefix_tokens)
        if not held:
            return [], 0
        n = min(adm.free_seqs - count, int(room // max(max(held.values()), 1.0)))
        return (sorted(held, key=held.get), n) if n > 0 else ([], 0)

    def queue_reads(self, pipe, request: ReadRequest) -> QueuedReads:
        """Queue the request's reads on the step's pipeline: the held lanes' first, so their jobs are taken before
        the refill read claims the room they fit in."""
        held = new = None
        if request.held:
            plan = self.affinity.held_plan(request.lanes)
            plan.steal_max = request.held  # their jobs share a prefix in our cache: sized to fit as tails, to start now
            plan.handed = False  # a job handed back is a whole one: the refill read takes it
            held = self.reader.queue(pipe, request.held, plan)
        if request.count:
            new = self.reader.queue(pipe, request.count, self._plan(request.reclaim_ms), request.reclaim_ms)
        elif request.preempt:
            plan = self._plan(0)
            # a band's shares count the jobs of every shard (Fair.band_of_job): the look may take from any of them
            plan.preempt_ms = self.settings.fair_preempt_ms
            plan.occupancy = {b: here for band, here in request.preempt.items() for b in self.fair.siblings_of(band)}
            new = self.reader.queue(pipe, 1, plan)
        return QueuedReads(request, held, new, FullOwners(self.affinity, self.affinity.look(pipe)))

    def queue_spread(self, pipe) -> int:
        """On a Redis Cluster, what the last reads charged tenants in one shard, queued onto their counters in the
        others (Fair.queue_spread); how many commands."""
        return self.fair.queue_spread(pipe) if self.fair.charged_here else 0

    def settle(self, sent: QueuedReads) -> list[Entry]:
        """The entries the round trip's reads took, to accept."""
        held = sent.held.entries if sent.held is not None else []
        if sent.held is not None and not held:
            self.held_dry_until = time.monotonic() + self.settings.affinity_steal_age_ms / 1000
        new = sent.new.entries if sent.new is not None else []
        r = sent.request
        if r.preempt:  # none found is the common answer: no backoff for it
            self._took_fair(new)
            return new
        return self.took(held + new, r.count + r.held, r.reclaim_ms, len(new) < r.count)

    # ---- both ------------------------------------------------------------------------------------------
    def _plan(self, reclaim_ms: int, full: bool = False) -> ReadPlan:
        plan = self.affinity.read_plan(full=full or reclaim_ms > 0)  # a reclaim looks at every lane
        if self.models_now is not None and not self.affinity.lanes:  # LoRA adapters without room here are left
            names = self.models_now.now()
            plan.streams, plan.per_priority = self.keys.served_jobs(names), len(names)
        lag = self.settings.affinity_max_lag_ms
        plan.overdue_ms = self.affinity.own_wait_ms + lag if lag else 0
        # A stolen job should start now, not wait in our local queue behind a wrong size estimate: one at a time,
        # and none while jobs wait here already.
        plan.steal_max = 0 if self.queue.tickets else 1
        if self.fair.active:  # tenants' streams after each band's shared stream, by virtual token counters
            plan.fair, plan.weights = self.fair.bands, self.fair.weights
            plan.charge = self.fair.read_charge(self.queue.tokens_per_job)
        return plan

    def _reclaim_ms(self) -> int:
        return self.settings.reclaim_idle_ms if self.reclaim_due else 0

    def took(self, got: list[Entry], count: int, reclaim_ms: int, drained: bool) -> list[Entry]:
        """Learn from what a read took (lanes' waits, steals, reclaims, an empty backlog); the entries to accept."""
        if self.affinity.lanes:
            self._observe_lanes(got, drained)
        self._took_fair(got)
        if reclaim_ms:
            claimed = sum(1 for e in got if not e.handed_back and (e.deliveries > 1 or e.fields is None))
            self.reclaim_due = claimed >= count  # a full take may have left more behind
            if claimed:
                log.info("reclaimed %d entries idle past %d ms", claimed, reclaim_ms)
        if not got:
            self.last_read_empty_at = time.monotonic()
            self.empty_reads += 1
        else:
            self.empty_reads = 0
        return got

    def _took_fair(self, got: list[Entry]) -> None:
        """Remember what each job read from a tenant's stream was charged, and the tenants' streams read lately."""
        if not self.fair.active:
            return
        self.fair.read([e for e in got if not e.handed_back], self.queue.tokens_per_job)  # charged by the first read
        for e in got:
            if self.fair.band_of(e.stream) is not None:
                self.tenant_streams.pop(e.stream, None)
                self.tenant_streams[e.stream] = None
        while len(self.tenant_streams) > TENANT_STREAMS:
            del self.tenant_streams[next(iter(self.tenant_streams))]

    def _observe_lanes(self, got: list[Entry], drained: bool) -> None:
        fresh = [e for e in got if e.deliveries == 1 and not e.handed_back]
        stolen = [e for e in fresh if self.affinity.stolen(e.stream)]
        if stolen:
            self.metrics.on_steals(len(stolen))
            for stream in dict.fromkeys(e.stream for e in reversed(stolen)):
                self.affinity.stole(stream)
        now_ms = int(self.clock.now() * 1000)
        ages = [now_ms - entry_ms(e.entry_id) for e in fresh if not self.affinity.stolen(e.stream)]
        self.affinity.observe(ages, drained)


def _delivered(groups) -> str:
    """From an XINFO GROUPS reply: the id past which the workers' group has delivered nothing ('$' without it: the
    next entry added)."""
    if isinstance(groups, Exception):
        return "$"
    return next((as_text(g["last-delivered-id"]) for g in groups if as_text(g.get("name")) == Keys.GROUP), "$")
