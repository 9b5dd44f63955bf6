"""Prefix affinity on the worker side: which lanes this worker owns, and the order it reads streams in.

The namespace's lane count lives in `{ns}:lanes`, set once (SET NX) by the first worker started with affinity on
and never changed by kvgate, so no job can land in a lane beyond the count. Every worker reads every stream the
count names, whatever its own setting, plus the shared streams (jobs from producers that have not seen the count
yet, or from before lanes existed): a job is never stranded by a lane nobody reads, only read later or earlier.

Ownership: workers with affinity on put themselves in the ring `{ns}:lanes:ring` on every heartbeat (scored by
the server's clock, so clocks of different machines never meet); members silent past the heartbeat TTL drop out,
and a draining worker leaves at once. Each lane belongs to one member by weighted rendezvous (producer/lanes.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis

from kvgate.producer.lanes import digest, decode_members, encode_member, owned, parse_lanes
from kvgate.producer.protocol import PRIORITIES, Keys

log = logging.getLogger("kvgate.worker")
OVERDUE_CHECKS = 4  # others' lanes per priority looked at for overdue jobs on each read
STEAL_WINDOW = 8  # others' lanes per priority a read may steal from, besides those we helped lately
HELPED = 4  # others' lanes we remember stealing from, looked at first when we steal again

# KEYS[1] ring; ARGV: our member ('' when we only look), ttl ms. Server time: every member scored by one clock.
RING_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now, ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""


@dataclass(slots=True)
class Affinity:
    client: redis.Redis
    keys: Keys
    worker_id: str
    enabled: bool
    want_lanes: int  # the count this worker proposes when the namespace has none yet
    ring_ttl_ms: int
    weight: float = 1.0  # our share of lanes relative to other members: the KV blocks we hold
    lanes: int = 0  # the namespace's count once seen; never shrinks while we run
    own: list[int] = field(default_factory=list)
    own_streams: set[str] = field(default_factory=set)
    lane_streams: set[str] = field(default_factory=set)
    names: dict[str, list[str]] = field(default_factory=dict)  # priority -> stream of each lane
    others: list[int] = field(default_factory=list)  # lanes other workers own
    others_set: set[int] = field(default_factory=set)
    lane_of_stream: dict[str, int] = field(default_factory=dict)
    helped: list[int] = field(default_factory=list)  # others' lanes we stole from, most recent first
    own_wait_ms: int = 0  # age of the jobs we last read from our own lanes
    member: str = ""
    turn: int = 0  # rotates the start of each group of lanes, so no lane is always read last
    script: object = None

    def __post_init__(self) -> None:
        self.script = self.client.register_script(RING_LUA)
        self.turn = digest(self.worker_id.encode())  # workers' windows move in different phases
        self.member = encode_member(self.worker_id, self.weight)

    def sync(self) -> bool:
        """Read the lane count (proposing ours first), beat in the ring and recompute our lanes. Returns whether
        the set of streams to read grew (a count seen for the first time)."""
        pipe = self.client.pipeline(transaction=False)
        if self.enabled:
            pipe.set(self.keys.lanes(), self.want_lanes, nx=True)
            self.script(keys=[self.keys.lane_ring()], args=[self.member, self.ring_ttl_ms], client=pipe)
        pipe.get(self.keys.lanes())
        replies = pipe.execute()
        grew = self._see_count(replies[-1])
        if self.enabled:
            self._own(owned(decode_members(replies[1]), self.worker_id, self.lanes) if self.lanes else [])
        return grew

    def _own(self, lanes: list[int]) -> None:
        if lanes != self.own:
            log.info("worker %s owns %d of %d lanes", self.worker_id, len(lanes), self.lanes)
        self.own = lanes
        self.own_streams = {self.keys.jobs(p, lane) for p in PRIORITIES for lane in lanes}
        self.others = [lane for lane in range(self.lanes) if lane not in set(lanes)]
        self.others_set = set(self.others)

    def _see_count(self, raw) -> bool:
        count = parse_lanes(raw)
        if count and self.enabled and count != self.want_lanes and not self.lanes:
            log.warning("namespace %s has %d lanes (set by the first worker with affinity on); using them, not %d",
                        self.keys.ns, count, self.want_lanes)
        if count > self.lanes:
            self.lanes = count
            self.names = {p: [self.keys.jobs(p, lane) for lane in range(count)] for p in PRIORITIES}
            self.lane_streams = {name for names in self.names.values() for name in names}
            self.others = [lane for lane in range(count) if lane not in set(self.own)]
            self.others_set = set(self.others)
            self.lane_of_stream = {name: lane for names in self.names.values() for lane, name in enumerate(names)}
            return True
        return False

    def leave(self) -> None:
        """Draining: give our lanes to the others now rather than when our beat expires."""
        self._own([])
        if self.enabled:
            self.client.zrem(self.keys.lane_ring(), self.member)

    def streams(self) -> list[str]:
        """Every stream we read: the shared ones and each lane's."""
        return self.keys.all_jobs(self.lanes)

    def read_plan(self, full: bool = False) -> tuple[list[str], int | None, list[str]]:
        """The streams to read in order; how many lead them that are ours (None: no owners, no stealing); and a
        few of the others' lanes to check for overdue jobs. Per priority our own lanes and the shared stream, then
        the lanes we stole from lately, then a window of the other lanes that moves on every read (`full`: all of
        them, for a reclaim pass), so a read costs the same with 16 lanes or 1,024 and no lane is always last."""
        self.turn += 1
        if not self.lanes:
            return self.keys.all_jobs(), None, []
        own = _rotated(self.own if self.enabled else [], self.turn)
        first = [name for p in PRIORITIES for name in [*(self.names[p][lane] for lane in own), self.keys.jobs(p)]]
        if not self.enabled:
            return first + [self.names[p][lane] for p in PRIORITIES for lane in _rotated(self.others, self.turn)], \
                None, []
        helped = [lane for lane in self.helped if lane in self.others_set]
        spread = [lane for lane in _rotated(self.others, self.turn * STEAL_WINDOW) if lane not in set(helped)]
        steal = helped + (spread if full else spread[:STEAL_WINDOW])
        overdue = helped[:OVERDUE_CHECKS // 2] + spread[:OVERDUE_CHECKS - len(helped[:OVERDUE_CHECKS // 2])]
        return (first + [self.names[p][lane] for p in PRIORITIES for lane in steal], len(first),
                [self.names[p][lane] for p in PRIORITIES for lane in overdue])

    def stole(self, stream: str) -> None:
        """Remember the lane: its prefix is in our cache now, so we look there first the next time we steal
        (a lane too hot for its owner gets a steady set of helpers instead of every worker in turn)."""
        lane = self.lane_of_stream.get(stream)
        if lane is None:
            return
        if lane in self.helped:
            self.helped.remove(lane)
        self.helped.insert(0, lane)
        del self.helped[HELPED:]

    def observe(self, own_ages_ms: list[int], drained: bool) -> None:
        """How long jobs in our own lanes have been waiting: 0 once a read found them empty."""
        if drained:
            self.own_wait_ms = 0
        elif own_ages_ms:
            self.own_wait_ms = max(own_ages_ms)

    def home(self) -> list[str]:
        """What an idle worker blocks on: the shared streams and our own lanes (others are looked at on each
        non-blocking read, so a job in a busy owner's lane waits at most one blocking timeout for a thief)."""
        return [st for p in PRIORITIES for st in [self.keys.jobs(p), *(self.keys.jobs(p, lane) for lane in self.own)]]

    def stolen(self, stream: str) -> bool:
        """A lane stream we read although another worker owns it."""
        return self.enabled and stream in self.lane_streams and stream not in self.own_streams


def _rotated(items: list[int], turn: int) -> list[int]:
    if not items:
        return items
    k = turn % len(items)
    return items[k:] + items[:k]
