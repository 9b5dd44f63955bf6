"""Prefix affinity on the worker side: which lanes this worker owns, and the order it reads streams in.

Lanes are a dimension of each model's streams (`{ns}:jobs:<model>:<priority>:<lane>`). The namespace's lane count,
one for every model, lives in `{ns}:lanes`, set once (SET NX) by the first worker started with affinity on
and never changed by kvgate, so no job can land in a lane beyond the count. Every worker reads every stream the
count names, whatever its own setting, plus the shared streams (jobs from producers that have not seen the count
yet, or from before lanes existed): a job is never stranded by a lane nobody reads, only read later or earlier.

Ownership is per model, since a worker can hold the prefixes only of models it serves: workers with affinity on
put themselves in the ring `{ns}:lanes:ring:<model>` of every model name they serve on every heartbeat (scored by
the server's clock, so clocks of different machines never meet); members silent past the heartbeat TTL drop out,
and a draining worker leaves at once; one silent past the reclaim timeout owns no lanes even before that
(lane_lapse_ms), so a killed owner's queued jobs restart as soon as its pending ones. Each lane belongs to one
member by weighted rendezvous (producer/lanes.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import redis

from kvgate.producer.cluster import run_script
from kvgate.producer.lanes import digest, decode_members, encode_member, owners, parse_lanes
from kvgate.producer.keys import DEFAULT_MODEL, PRIORITIES, Keys, as_text
from kvgate.producer.redis_url import FAILOVER_ERRORS
from kvgate.worker.read_plan import ReadPlan
from kvgate.worker.named import Named

log = logging.getLogger("kvgate.worker")
OVERDUE_CHECKS = 4  # others' lanes per model and priority looked at for overdue jobs on each read
STEAL_WINDOW = 8  # others' lanes per model and priority a read may steal from, besides those we helped lately
HELPED = 4  # others' lanes we remember stealing from, looked at first when we steal again
RETELL_S = 2.0  # say again whether we are full this often, so a Redis restart or a lost write heals

# KEYS[1] ring; ARGV: our member ('' when we only look), ttl ms, lapse ms. Server time: every member scored by one
# clock. Returns the members that beat within the lapse: the ones that own lanes. A member silent past it stays
# listed until the ttl, but its lanes are the others' now, so the jobs queued there wait no longer than its pending
# ones, which a reclaim takes once idle that long (issue 45.8: they waited for the ttl, up to 10.8 s).
RING_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now, ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
return redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[3]), '+inf')
"""


# The read script's part (worker/reader.py READ_LUA, its locals there; `input.lanes`: lane_read_inputs, and each
# stream's `lane`: 'own' (or none: ours, or no lanes), 'urgent' (a lane of an owner that said it is full: taken
# without waiting the steal age) or 'other' (another worker's lane). A new entry in another's lane is taken only once
# it is steal_age ms old (its owner gets the first chance; stream ids are server ms), and a read takes at most
# steal_max entries from others' lanes in all. `overdue`: a few others' lanes ({key, due}: KEYS indexes of the lane and
# its due index) whose entries older than overdue_ms are taken before our own (their owner is not keeping up; a few
# lanes per read keeps the cost flat in the number of lanes). Lanes are read in deadline order (due.py's `take`): an
# entry parked there is delivered, so ripeness counts a lane's parked entries by their arrival before its new ones,
# and a read takes as many as are ripe, earliest due first.
LANES_READ_LUA = """
local lanes = input.lanes or {}
local steal_age, steal_max = lanes.steal_age or 0, lanes.steal_max or want
local function ripe(key, n, cutoff)  -- how many of the next n entries (parked, then new) arrived by the cutoff
  if n <= 0 then return 0 end
  local k = parked_by(key, n, cutoff)
  local last = delivered(key)
  if not last or k >= n then return k end
  for _, e in ipairs(redis.call('XRANGE', key, '(' .. last, '+', 'COUNT', n - k)) do
    if tonumber(string.match(e[1], '^(%d+)')) > cutoff then break end
    k = k + 1
  end
  return k
end
local function lane_take(stream)  -- the new entries a read takes from this stream now
  if not stream.lane or stream.lane == 'own' then return take(KEYS[stream.key], want) end
  local n = math.min(want, steal_max)
  if steal_age > 0 and stream.lane == 'other' then n = ripe(KEYS[stream.key], n, now - steal_age) end
  local entries = take(KEYS[stream.key], n)
  steal_max = steal_max - #entries
  return entries
end
local function overdue_first()  -- others' lanes' entries older than overdue_ms, before our own
  if (lanes.overdue_ms or 0) <= 0 or preempt_ms > 0 then return end
  for _, lane in ipairs(lanes.overdue or {}) do
    if want <= 0 then break end
    local key = KEYS[lane.key]
    local entries = take(key, ripe(key, math.min(want, steal_max), now - lanes.overdue_ms))
    steal_max = steal_max - #entries
    if #entries > 0 then table.insert(out, {'stream', key, 'new', entries}) end
  end
end
"""


def lane_read_inputs(steal_age_ms: int, steal_max: int, overdue_ms: int, overdue: list[dict]) -> dict:
    """The read script's lane inputs (LANES_READ_LUA's `input.lanes`); `overdue`: others' lanes to check for overdue
    entries, each {key, due}: the KEYS indexes of the lane and of its due index (worker/due.py)."""
    return {"steal_age": steal_age_ms, "steal_max": steal_max, "overdue_ms": overdue_ms, "overdue": overdue}


Lane = tuple[str, int]  # (model, lane number)


@dataclass(slots=True)
class Affinity:
    client: redis.Redis
    keys: Keys
    worker_id: str
    enabled: bool
    want_lanes: int  # the count this worker proposes when the namespace has none yet
    ring_ttl_ms: int
    weight: float = 1.0  # our share of lanes relative to other members: the KV blocks we hold
    lapse_ms: int | None = None  # a member silent this long owns no lanes (lane_lapse_ms); None: the ring's ttl
    models: tuple[str, ...] = (DEFAULT_MODEL,)  # the names we serve, in the order the worker reads them
    lanes: int = 0  # the namespace's count once seen; never shrinks while we run
    own: dict[str, list[int]] = field(default_factory=dict)  # model -> the lanes of it we own
    own_streams: set[str] = field(default_factory=set)
    lane_streams: set[str] = field(default_factory=set)
    names: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (model, priority) -> stream of each lane
    others: dict[str, list[int]] = field(default_factory=dict)  # model -> its lanes other workers own
    lane_of_stream: dict[str, Lane] = field(default_factory=dict)
    helped: list[Lane] = field(default_factory=list)  # others' lanes we stole from, most recent first
    own_wait_ms: int = 0  # age of the jobs we last read from our own lanes
    member: str = ""
    ring_seen: dict[str, tuple] = field(default_factory=dict)  # model -> (its ring and count, every lane's owner)
    full: set[str] = field(default_factory=set)  # other members that said they cannot take a job now
    unowned: set[str] = field(default_factory=set)  # models we serve whose ring has no live member: lanes nobody owns
    told_full: bool | None = None  # what we last said of ourselves
    retell_at: float = 0.0
    turn: int = 0  # rotates the start of each group of lanes, so no lane is always read last
    script: object = None

    def __post_init__(self) -> None:
        self.script = self.client.register_script(RING_LUA)
        self.turn = digest(self.worker_id.encode())  # workers' windows move in different phases
        self.member = encode_member(self.worker_id, self.weight)
        self.others = {m: [] for m in self.models}

    @property
    def owned_count(self) -> int:
        return sum(len(lanes) for lanes in self.own.values())

    def sync(self) -> bool:
        """Read the lane count (proposing ours first), beat in our models' rings and recompute our lanes. Returns
        whether the set of streams to read grew (a count seen for the first time)."""
        named = Named(self.client.pipeline(transaction=False))
        if self.enabled:
            named.on("proposed").set(self.keys.lanes(), self.want_lanes, nx=True)
        lapse_ms = min(self.lapse_ms or self.ring_ttl_ms, self.ring_ttl_ms)
        # without affinity we only look: a model nobody owns has lanes nobody waits on; and without lanes in the
        # namespace there is nothing to look for (a script a model every heartbeat: 201 with 200 LoRA adapters)
        looked = self.models if self.enabled or self.lanes else ()
        for model in looked:
            run_script(self.script, [self.keys.lane_ring(model)],
                       [self.member if self.enabled else "", self.ring_ttl_ms, lapse_ms], named.on(("ring", model)))
        named.on("count").get(self.keys.lanes())
        replies = named.execute()
        grew = self._see_count(replies["count"])
        rings = {m: decode_members(replies["ring", m]) if m in looked else {} for m in self.models}
        self.unowned = {m for m in self.models if not rings[m]}
        if self.enabled:
            self._own({m: self._owned(m, rings[m]) for m in self.models})
            self._forget_departed(rings)
        return grew

    def add_models(self, models: list[str]) -> None:
        """Names we serve from now on (LoRA adapters registered since we started): their rings, lanes and streams,
        so a job a producer sent to one of their lanes is read (the next `sync` beats in their rings)."""
        new = [m for m in models if m not in self.models]
        if new:
            self.models = (*self.models, *new)
            self.others.update({m: [] for m in new})
            self._name_lanes(self.lanes)

    def _forget_departed(self, rings: dict[str, dict[str, float]]) -> None:
        """A worker killed while full stays in the full sets: drop members that left (or went silent in) every ring
        we see."""
        gone = self.full - {w for members in rings.values() for w in members}
        if gone:
            pipe = self.client.pipeline(transaction=False)
            for model in self.models:
                pipe.zrem(self.keys.lanes_full(model), *gone)
            pipe.execute()
            self.full -= gone

    def _owned(self, model: str, members: dict[str, float]) -> list[int]:
        """Our lanes of the model; the owners are recomputed only when its ring or the count changed (a beat per
        second on every worker would otherwise score every lane against every member each time)."""
        if not self.lanes:
            return []
        seen = (tuple(sorted(members.items())), self.lanes)
        if self.ring_seen.get(model, (None,))[0] != seen:
            self.ring_seen[model] = (seen, owners(members, self.lanes))
        return [lane for lane, owner in enumerate(self.ring_seen[model][1]) if owner == self.worker_id]

    def owner(self, model: str, lane: int) -> str | None:
        seen = self.ring_seen.get(model)
        return seen[1][lane] if seen and lane < len(seen[1]) else None

    def tell(self, pipe, room: bool) -> int:
        """Queue on `pipe` whether we can take a job of our lanes now (when that changed, or is due again); how
        many commands. While we cannot, the others take our lanes' jobs at once rather than after the steal age:
        waiting for us would only add to their wait. Nothing is said without lanes."""
        if not (self.enabled and self.lanes and self.own):  # a worker that left the ring has nothing to say
            return 0
        now = time.monotonic()
        if (not room) == self.told_full and now < self.retell_at:
            return 0
        self.told_full, self.retell_at = not room, now + RETELL_S
        for model in self.models:
            if room:
                pipe.zrem(self.keys.lanes_full(model), self.worker_id)
            else:
                pipe.zadd(self.keys.lanes_full(model), {self.worker_id: 0})
        return len(self.models)

    def look(self, pipe) -> int:
        """Queue on `pipe` the reads of who is full now, for the next read plan; how many commands."""
        if not (self.enabled and self.lanes):
            return 0
        for model in self.models:
            pipe.zrange(self.keys.lanes_full(model), 0, -1)
        return len(self.models)

    def seen(self, replies: list) -> None:
        self.full = {as_text(w) for reply in replies for w in reply} - {self.worker_id}

    def _own(self, own: dict[str, list[int]]) -> None:
        if own != self.own:
            log.info("worker %s owns %s of %d lanes each", self.worker_id,
                     ", ".join(f"{len(lanes)} of {m}" for m, lanes in own.items()), self.lanes)
        self.own = own
        self.own_streams = {st for m, lanes in own.items() for p in PRIORITIES for lane in lanes
                            for st in self.names[m, p][lane]}
        self._others()

    def _others(self) -> None:
        self.others = {m: [lane for lane in range(self.lanes) if lane not in set(self.own.get(m, ()))]
                       for m in self.models}

    def _see_count(self, raw) -> bool:
        count = parse_lanes(raw)
        if count and self.enabled and count != self.want_lanes and not self.lanes:
            log.warning("namespace %s has %d lanes (set by the first worker with affinity on); using them, not %d",
                        self.keys.ns, count, self.want_lanes)
        if count > self.lanes:
            self._name_lanes(count)
            return True
        return False

    def _name_lanes(self, count: int) -> None:
        """The streams of `count` lanes of every model we serve."""
        self.lanes = count
        shards = range(len(self.keys.parts))  # on a Redis Cluster a lane has a stream in every shard
        self.names = {(m, p): [tuple(self.keys.jobs(m, p, lane, k) for k in shards) for lane in range(count)]
                      for m in self.models for p in PRIORITIES}
        self.lane_streams = {name for names in self.names.values() for lane in names for name in lane}
        self.lane_of_stream = {name: (m, lane) for (m, _), names in self.names.items()
                               for lane, streams in enumerate(names) for name in streams}
        self._others()

    def leave(self) -> None:
        """Draining: give our lanes to the others now rather than when our beat expires (Redis out of reach: then)."""
        self._own({})
        if self.enabled:
            pipe = self.client.pipeline(transaction=False)
            for model in self.models:
                pipe.zrem(self.keys.lane_ring(model), self.member)
                pipe.zrem(self.keys.lanes_full(model), self.worker_id)
            try:
                pipe.execute()
            except FAILOVER_ERRORS:
                log.warning("could not leave the lane ring; our lanes move when our beat there expires")

    def streams(self) -> list[str]:
        """Every stream we read: each served model's shared ones and its lanes'."""
        return [st for m in self.models for st in self.keys.all_jobs(m, self.lanes)]

    def read_plan(self, full: bool = False) -> ReadPlan:
        """The streams to read in order; how many lead them that are ours (None: no lanes, the reader takes
        turns between models itself); how many follow those that are lanes of full owners (taken at once); and a
        few of the others' lanes to check for overdue jobs. Per priority, for each model in turn, our own lanes
        and the shared stream; then lanes whose owners said they are full; then, per priority and model, the
        lanes we stole from lately and a window of the other lanes that moves on every read (`full`: all of
        them, for a reclaim pass), so a read costs the same with 16 lanes or 1,024 and no lane is always last."""
        self.turn += 1
        if not self.lanes:
            return ReadPlan(self.keys.served_jobs(list(self.models)))
        models = _rotated(list(self.models), self.turn)  # models take turns at going first within a priority
        own = {m: _rotated(self.own.get(m, []) if self.enabled else [], self.turn) for m in models}
        first = [name for p in PRIORITIES for m in models
                 for name in [*(st for lane in own[m] for st in self.names[m, p][lane]), *self._shared(m, p)]]
        if not self.enabled:
            rest = self._lanes_of(models, lambda m: _rotated(self.others[m], self.turn))
            return ReadPlan(first + rest, len(first + rest))
        urgent, steal, overdue = {}, {}, {}
        for m in models:
            urgent[m], steal[m], overdue[m] = self._steal_window(m, full)
        now, later = self._lanes_of(models, urgent.get), self._lanes_of(models, steal.get)
        return ReadPlan(first + now + later, len(first), len(now), self._lanes_of(models, overdue.get))

    def held_plan(self, lanes: list[Lane]) -> ReadPlan:
        """A read of only these lanes (their prefix is in our cache): ours first, then those of owners that said
        they are full (taken at once), then the other owners' (once ripe: the owner keeps its first chance); how
        many lead as ours, and how many follow those as full owners'."""
        mine = [lane for lane in lanes if lane[1] in self.own.get(lane[0], ())]
        full = [lane for lane in lanes if lane not in mine and self.owner(*lane) in self.full]
        rest = [lane for lane in lanes if lane not in mine and lane not in full]
        groups = [[st for p in PRIORITIES for m, lane in group for st in self.names[m, p][lane]]
                  for group in (mine, full, rest)]
        return ReadPlan(groups[0] + groups[1] + groups[2], len(groups[0]), len(groups[1]))

    def lane_of(self, stream: str) -> Lane | None:
        return self.lane_of_stream.get(stream)

    def _shared(self, model: str, priority: str) -> list[str]:
        """The model's shared stream of a priority, in every shard."""
        return [self.keys.jobs(model, priority, shard=k) for k in range(len(self.keys.parts))]

    def _lanes_of(self, models: list[str], lanes_of) -> list[str]:
        """Per priority and model, the streams (every shard's) of the lanes `lanes_of(model)` names."""
        return [st for p in PRIORITIES for m in models for lane in lanes_of(m) for st in self.names[m, p][lane]]

    def _steal_window(self, model: str, full: bool) -> tuple[list[int], list[int], list[int]]:
        """Others' lanes of one model: those of full owners (helped first, then the moving window's order), those
        to steal from on this read once ripe, and those to check for overdue jobs."""
        others = set(self.others[model])
        helped = [lane for m, lane in self.helped if m == model and lane in others]
        spread = [lane for lane in _rotated(self.others[model], self.turn * STEAL_WINDOW) if lane not in set(helped)]
        urgent = [lane for lane in helped + spread if self.owner(model, lane) in self.full] if self.full else []
        del urgent[STEAL_WINDOW:]  # under a backlog everyone is full: a read must not grow to every lane
        if urgent:
            helped = [lane for lane in helped if lane not in urgent]
            spread = [lane for lane in spread if lane not in urgent]
        steal = helped + (spread if full else spread[:STEAL_WINDOW])
        overdue = helped[:OVERDUE_CHECKS // 2] + spread[:OVERDUE_CHECKS - len(helped[:OVERDUE_CHECKS // 2])]
        return urgent, steal, overdue

    def stole(self, stream: str) -> None:
        """Remember the lane: its prefix is in our cache now, so we look there first the next time we steal
        (a lane too hot for its owner gets a steady set of helpers instead of every worker in turn)."""
        lane = self.lane_of_stream.get(stream)
        if lane is None:
            return
        if lane in self.helped:
            self.helped.remove(lane)
        self.helped.insert(0, lane)
        del self.helped[HELPED * len(self.models):]

    def observe(self, own_ages_ms: list[int], drained: bool) -> None:
        """How long jobs in our own lanes have been waiting: 0 once a read found them empty."""
        if drained:
            self.own_wait_ms = 0
        elif own_ages_ms:
            self.own_wait_ms = max(own_ages_ms)

    def home(self) -> list[str]:
        """What an idle worker blocks on: per priority, each model's shared stream and our own lanes of it (others
        are looked at on each non-blocking read, so a job in a busy owner's lane waits at most one blocking
        timeout for a thief); then the lanes of the models we serve that no live member owns (served only by
        workers without affinity: nobody else waits on them, and each of their jobs waited a whole blocking timeout,
        201 ms at the median against 4 ms in the shared stream, issue 45). They come last: a wait covers as many
        streams as jobs fit, and the shared streams must stay in it. Models take turns at going first, as in
        read_plan."""
        models = _rotated(list(self.models), self.turn)
        ours = [st for p in PRIORITIES for m in models
                for st in [*self._shared(m, p), *(s for lane in self.own.get(m, []) for s in self.names[m, p][lane])]]
        return ours + self._lanes_of([m for m in models if m in self.unowned], lambda m: range(self.lanes))

    def stolen(self, stream: str) -> bool:
        """A lane stream we read although another worker owns it."""
        return self.enabled and stream in self.lane_streams and stream not in self.own_streams


def lane_lapse_ms(reclaim_idle_ms: int, heartbeat_interval_s: float) -> int:
    """How long a ring member may be silent before the others read its lanes as their own: the reclaim timeout,
    after which its pending jobs are taken over too (a worker stalled that long has lost its jobs anyway), so its
    queued jobs restart within the same bound; but at least two beats, so a live member never looks silent between
    them."""
    return max(reclaim_idle_ms, int(2000 * heartbeat_interval_s))


def kv_weight(total_blocks: int) -> float:
    """Our share of lanes follows the KV blocks we hold: that is where a prefix cache lives."""
    return float(total_blocks) if total_blocks > 0 else 1.0


def _rotated(items: list, turn: int) -> list:
    if not items:
        return items
    k = turn % len(items)
    return items[k:] + items[:k]
