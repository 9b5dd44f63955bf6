"""Reading jobs in priority order in one round trip: a dead worker's entries first, then new ones.

Separate XREADGROUP calls per priority cost up to three round trips per look, most of them on empty
streams; a script reads high, then normal, then low, until `count` entries are taken, and never more.
When a reclaim is due, the entries of every stream idle past the reclaim timeout (their worker is dead)
are taken over before any new entry is read: sized by free slots like any read, a reclaim that ran apart
from the reads found those slots already filled by new entries, and under sustained load orphans waited
until the producer stopped; one that went stream by stream found them filled by the reader's own lanes, so
a killed owner's lanes waited for its ring beat to expire (issue 26.7).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import redis

from kvgate.producer.cluster import run_script
from kvgate.producer.keys import Keys
from kvgate.worker.affinity import LANES_READ_LUA, lane_read_inputs
from kvgate.worker.due import DUE_READ_LUA, due_read_inputs
from kvgate.worker.fair import TENANTS_READ_LUA
from kvgate.worker.hand_back import TAKE_HANDED_LUA, hand_back_inputs
from kvgate.worker.read_plan import ReadPlan
from kvgate.worker.read_reply import Entry, ReadReply
from kvgate.worker.shard_turns import ShardTurns

# KEYS: every key the read touches, each named by its index in the inputs. ARGV[1]: the inputs, one JSON object read
# by name (ScriptInputs): group, consumer, want (jobs wanted), reclaim_ms (0: no reclaim), and `streams`, the job
# streams in the order read, highest priority first, each {key (its KEYS index), lane (affinity.py), tenants (a
# band's tenants' streams: fair.py), due (its due index: due.py)}; `handed`, the hand-back index (hand_back.py); `lanes`
# (affinity.py; its overdue lanes {key, due} as streams); `shares`; `due` (deadline order: due.py, which reads new
# entries, lanes' too, and takes orphans over).
# Each feature's part of the script lives beside its owner and is spliced in below; they share the locals here.
# A takeover counts one more delivery (XCLAIM RETRYCOUNT; JUSTID claims count none; a handed-back entry's take counts
# none), and its payload is read with XRANGE: the same replies on 6.2 and 7 whether or not the entry was trimmed or
# deleted while pending.
# Returns named fields: {'streams', {per stream with entries: {'stream', key, 'new', [id, fields]..., 'taken' or
# 'handed', [id, fields or false, deliveries]..., 'few', 'alone'}}, 'queued', {band, jobs still queued...}}, taken
# apart in one place (ReadReply).
READ_LUA = """
local input = cjson.decode(ARGV[1])
local group, consumer, want = input.group, input.consumer, input.want
local min_idle, streams = input.reclaim_ms or 0, input.streams
local handed, grace = nil, 0
if input.handed then handed, grace = KEYS[input.handed.key], input.handed.grace end
local preempt_ms = input.shares and input.shares.preempt_ms or 0
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
local function delivered(key)  -- the group's last delivered id in this stream, or nil where it has no group
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', key)) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == group then return f['last-delivered-id'] end
  end
  return nil
end
-- @DUE
-- @LANES
-- @TENANTS
local claimed = {}
if min_idle > 0 then  -- every stream's orphans before any new entry: our own lanes must not crowd out a dead owner's
  for i, stream in ipairs(streams) do
    if want <= 0 then break end
    local mine = orphans(KEYS[stream.key])
    if #mine > 0 then claimed[i] = mine end
  end
  for _, stream in ipairs(streams) do
    if stream.tenants then tenant_orphans(stream) end
  end
end
-- @TAKE_HANDED
overdue_first()
for i, stream in ipairs(streams) do
  local taken, entries = claimed[i] or {}, {}
  if want > 0 and preempt_ms == 0 then entries = lane_take(stream) end
  if #entries > 0 or #taken > 0 then  -- lanes: most are empty
    table.insert(out, {'stream', KEYS[stream.key], 'new', entries, 'taken', taken})
  end
  if stream.tenants and want > 0 and not looked then tenants_take(stream) end
end
return {'streams', out, 'queued', bands_queued()}
"""
for mark, part in (("-- @DUE\n", DUE_READ_LUA), ("-- @LANES\n", LANES_READ_LUA), ("-- @TENANTS\n", TENANTS_READ_LUA),
                   ("-- @TAKE_HANDED\n", TAKE_HANDED_LUA)):
    READ_LUA = READ_LUA.replace(mark, part.lstrip("\n"))


@dataclass(slots=True)
class ScriptKeys:
    """The KEYS of one script call, in the order added: each addition returns the index the inputs name it by."""

    keys: list[str] = field(default_factory=list)

    def add(self, key: str) -> int:
        self.keys.append(key)
        return len(self.keys)


@dataclass(slots=True)
class ShardCall:
    """One shard's read script call: its KEYS and named inputs (`want` set per call)."""

    shard: int
    keys: list[str]
    inputs: dict[str, Any]

    def args(self) -> list[str]:
        return [json.dumps(self.inputs, separators=(",", ":"))]


@dataclass(slots=True)
class ShardGroup:
    """A plan's streams in one shard, as one read script there looks at them."""

    shard: int
    streams: list[str] = field(default_factory=list)  # in plan order
    lanes: list[str] = field(default_factory=list)  # each stream's lane kind (ReadPlan.lane_of)
    overdue: list[str] = field(default_factory=list)  # others' lanes to check for overdue entries


@dataclass(slots=True)
class ReadSlot:
    """A read queued on a shared pipeline: its one reply parsed into entries when the round trip settles (and on
    a cluster, what its shard's bands still queue told to the reader's ShardTurns)."""

    entries: list[Entry] = field(default_factory=list)
    seen: Callable[[ReadReply], None] | None = None  # told the reply

    def take(self, replies: Iterator) -> None:
        reply = ReadReply.of(next(replies))
        self.entries = reply.entries()
        if self.seen is not None:
            self.seen(reply)


@dataclass(slots=True)
class Reader:
    """Without lanes, a plan's `streams` come priority by priority, `per_priority` (the models served) streams each:
    every model's high before any model's normal. Within one priority the models take turns at going first, so a
    busy model cannot starve another of the same priority when only a few jobs fit."""

    client: redis.Redis
    consumer: str
    plan: ReadPlan  # the last read's (an idle worker's blocking wait follows it)
    per_priority: int = 1
    script: object = None
    turn: int = 0
    steal_age_ms: int = 0
    keys: Keys | None = None  # on a Redis Cluster: tells which shard each stream is in
    shard_turn: int = 0
    turns: ShardTurns = field(default_factory=ShardTurns)  # a cluster, tenants' bands: the shards' turns by backlog
    handed_grace_ms: int = 0  # with keys: how long entries we handed back are left to others (worker/hand_back.py)
    deadline_window: int = 0  # with keys: entries parked per stream for deadline order (worker/due.py); 0: none

    def __post_init__(self) -> None:
        self.script = self.client.register_script(READ_LUA)

    def order(self) -> list[str]:
        streams = self.plan.streams
        n = self.plan.per_priority or self.per_priority  # a plan may leave out models (LoRA adapters without room)
        shift = self.turn % n
        blocks = [streams[i:i + n] for i in range(0, len(streams), n)]
        return [st for block in blocks for st in block[shift:] + block[:shift]]

    def read(self, count: int, plan: ReadPlan | None = None, reclaim_idle_ms: int = 0) -> list[Entry]:
        """Up to `count` entries, all of a higher priority before any of a lower one; with `reclaim_idle_ms`,
        a stream's entries idle that long before its new ones. `plan`: the streams to look at (None: the last
        plan's).

        On a Redis Cluster a script touches one shard (one slot): a read looks at the shards in turn, starting
        one further each time, each asked for an even part of what is still wanted (the last for all of it), then
        once more at those that gave their whole part, until `count` are taken. An idle fleet's first fill takes
        hundreds of jobs at once: taken from the first shard that had them, one tenant's backlog was left uneven
        over the shards, and in the end sat in a few of them, whose turns of the fleet's reads were less than its
        share (shard_turns.py)."""
        out: list[Entry] = []
        calls = self._scripts(count, plan, reclaim_idle_ms)
        again = []
        for i, call in enumerate(calls):
            if len(out) >= count:
                break
            call.inputs["want"] = -(-(count - len(out)) // (len(calls) - i))
            got = self._run(call)
            out += got
            if len(got) == call.inputs["want"] and i < len(calls) - 1:
                again.append(call)
        for call in again:
            if len(out) >= count:
                break
            call.inputs["want"] = count - len(out)
            out += self._run(call)
        return out

    def _run(self, call: ShardCall) -> list[Entry]:
        reply = ReadReply.of(run_script(self.script, call.keys, call.args(), self.client))
        self._seen(call, reply)
        return reply.entries()

    def _seen(self, call: ShardCall, reply: ReadReply) -> None:
        """What the read's shard still queues in its tenants' bands, per priority, for the shards' turns."""
        if len(self.keys.parts if self.keys else ()) > 1:
            by_priority: dict[str, int] = {}
            for band, n in reply.queued.items():
                priority = Keys.band_priority(band)
                by_priority[priority] = by_priority.get(priority, 0) + n
            self.turns.saw(call.shard, by_priority)

    def queue(self, pipe, count: int, plan: ReadPlan, reclaim_idle_ms: int = 0) -> ReadSlot:
        """The same read queued on `pipe`; on a cluster it looks at one shard, so priority holds within a shard
        and the shards take turns."""
        call = self._scripts(count, plan, reclaim_idle_ms)[0]
        run_script(self.script, call.keys, call.args(), pipe)
        return ReadSlot(seen=lambda reply: self._seen(call, reply))

    def _scripts(self, count: int, plan: ReadPlan | None, reclaim_idle_ms: int) -> list[ShardCall]:
        """Each shard's script call, in the order this read takes the shards: in turn, one further each time; with
        tenants' bands (but for a preempting look), the first by the shards' backlogs (ShardTurns)."""
        if plan is not None:
            self.plan = plan
        plan = self.plan
        if plan.home is not None:  # lanes: the plan is the affinity's, models' turns included
            streams, overdue = plan.streams, plan.overdue if plan.overdue_ms > 0 else []
        else:
            streams, overdue, self.turn = self.order(), [], self.turn + 1
        groups = self._by_shard(plan, streams, overdue)
        self.shard_turn += 1
        order = [groups[(self.shard_turn + i) % len(groups)] for i in range(len(groups))]
        if plan.by_backlog() and len(order) > 1:
            first = self.turns.next([g.shard for g in order])
            order.sort(key=lambda g: g.shard != first)
        return [self._call(group, plan, count, reclaim_idle_ms) for group in order]

    def _call(self, group: ShardGroup, plan: ReadPlan, count: int, reclaim_idle_ms: int) -> ShardCall:
        """One shard's script call: its keys, each named in the inputs by its index, and the features' inputs."""
        keys = ScriptKeys()
        inputs: dict[str, Any] = {"group": Keys.GROUP, "consumer": self.consumer, "want": count,
                                  "reclaim_ms": reclaim_idle_ms, "streams": []}
        due = self.keys is not None  # every stream's index, lanes' too: parked entries go first, window or not

        def named(stream: str) -> dict[str, int]:  # a stream's KEYS index, and its due index's (due.py)
            return {"key": keys.add(stream), **({"due": keys.add(self.keys.due_index(stream))} if due else {})}

        for stream, lane in zip(group.streams, group.lanes):
            inputs["streams"].append({**named(stream), "lane": lane})
            if (tenants := plan.tenants_inputs(stream, keys.add)) is not None:
                inputs["streams"][-1]["tenants"] = tenants
        if plan.home is not None:
            inputs["lanes"] = lane_read_inputs(self.steal_age_ms, plan.steal_max, plan.overdue_ms,
                                               [named(k) for k in group.overdue])
        if due:
            inputs["due"] = due_read_inputs(self.deadline_window)
        if (shares := plan.shares_inputs()) is not None:
            inputs["shares"] = shares
        if self.keys is not None and plan.handed:
            inputs["handed"] = hand_back_inputs(keys.add(self.keys.handed_back(group.shard)), self.handed_grace_ms)
        return ShardCall(group.shard, keys.keys, inputs)

    def _by_shard(self, plan: ReadPlan, streams: list[str], overdue: list[str]) -> list[ShardGroup]:
        """The plan's streams shard by shard (one group on a single Redis), each with its lane kind."""
        groups: dict[int, ShardGroup] = {}
        one = self.keys is None or len(self.keys.parts) == 1

        def group_of(stream: str) -> ShardGroup:
            shard = 0 if one else self.keys.of_stream(stream).shard
            return groups.setdefault(shard, ShardGroup(shard))

        for i, stream in enumerate(streams):
            g = group_of(stream)
            g.streams.append(stream)
            g.lanes.append(plan.lane_of(i))
        for stream in overdue:
            group_of(stream).overdue.append(stream)
        return [groups[k] for k in sorted(groups)] or [ShardGroup(0)]
