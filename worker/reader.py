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

from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import redis

from kvgate.producer.cluster import run_script
from kvgate.producer.keys import PRIORITIES, Keys, as_text
from kvgate.worker.fair import Occupancy
from kvgate.worker.hand_back import TAKE_HANDED_LUA

# KEYS: job streams, highest priority first (and last, with a grace of 0 or more, the shard's hand-back index); ARGV:
# group, consumer, count, reclaim min-idle ms (0: none), the grace in ms in which entries we handed back are left to
# others (-1: no index; worker/hand_back.py), and with affinity lanes: how many leading streams are ours (the rest
# are other workers' lanes, in a rotating order), the age
# in ms a new entry of theirs must reach before we take it (its owner gets the first chance; stream ids are server
# ms), and an overdue age with how many trailing KEYS are lanes to check for it: their entries that old are taken
# before our own (their owner is not keeping up; a few lanes per read keeps the cost flat in the number of lanes),
# and the most entries a read may take from their lanes in all; and how many of the streams right after ours are lanes
# of owners that said they are full: their entries are taken without waiting the steal age.
# With fair share, ARGV[12..]: how many bands are fair, the charge per job, the preempting look's wait in ms (0: a
# plain read; else only that look, below), how many triples follow and the triples (a band's index in KEYS, a tenant,
# 1 if a job of it may make room in the worker in that band, else 0; the tenant '' for a tenant not running there:
# worker/fair.py's Occupancy.makes_room), the bands' indexes in KEYS, then
# tenant/weight pairs. Each stream's reply is a StreamReply (below, named there).
# A takeover counts one more delivery (XCLAIM RETRYCOUNT; JUSTID claims count none; a handed-back entry's take counts
# none), and its payload is read with XRANGE: the same replies on 6.2 and 7 whether or not the entry was trimmed or
# deleted while pending.
# Returns {those streams' replies, and per fair band its index in KEYS and its jobs still queued (ShardTurns)}.
READ_LUA = """
local group, consumer = ARGV[1], ARGV[2]
local want, min_idle = tonumber(ARGV[3]), tonumber(ARGV[4])
local grace = tonumber(ARGV[5])
local nfair, charge = tonumber(ARGV[12] or 0), math.max(tonumber(ARGV[13] or 1), 1)
local handed = grace >= 0 and KEYS[#KEYS] or nil
local total = #KEYS - 2 * nfair - (handed and 1 or 0)  -- after the streams: fair keys, the hand-back index
local home, steal_age = tonumber(ARGV[6] or total), tonumber(ARGV[7] or 0)
local overdue_age, overdue_lanes = tonumber(ARGV[8] or 0), tonumber(ARGV[9] or 0)
local steal_max = tonumber(ARGV[10] or want)
local urgent = home + tonumber(ARGV[11] or 0)
local preempt_ms, ntriples = tonumber(ARGV[14] or 0), tonumber(ARGV[15] or 0)
local rooms = {}  -- a preempting look: band index -> tenant ('' for any other) -> 1 if its job may make room there
for j = 0, ntriples - 1 do
  local index, tenant, n = tonumber(ARGV[16 + 3 * j]), ARGV[17 + 3 * j], tonumber(ARGV[18 + 3 * j])
  rooms[index] = rooms[index] or {}
  rooms[index][tenant] = n
end
local after = 15 + 3 * ntriples
local fair_at, weights = {}, {}  -- band stream's index in KEYS -> its fair keys' position; tenant -> weight
for j = 1, nfair do fair_at[tonumber(ARGV[after + j])] = j end
for i = after + 1 + nfair, #ARGV - 1, 2 do weights[ARGV[i]] = math.max(tonumber(ARGV[i + 1]) or 1, 0.001) end
local last_key = total - overdue_lanes
local now = nil
if (home < last_key and (steal_age > 0 or overdue_age > 0)) or nfair > 0 or handed then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function delivered(key)  -- the group's last delivered id in this stream, or nil where it has no group
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', key)) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == group then return f['last-delivered-id'] end
  end
  return nil
end
local function ripe(key, n, cutoff)  -- how many of the next n new entries are at least as old as the cutoff
  if n <= 0 then return 0 end
  local last = delivered(key)
  if not last then return 0 end
  local k = 0
  for _, e in ipairs(redis.call('XRANGE', key, '(' .. last, '+', 'COUNT', n)) do
    if tonumber(string.match(e[1], '^(%d+)')) > cutoff then break end
    k = k + 1
  end
  return k
end
local function take(key, n)
  if n <= 0 then return {} end
  local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', key, '>')
  if not reply then return {} end
  want = want - #reply[1][2]
  return reply[1][2]
end
local out = {}
local function orphans(key)  -- entries idle past min_idle (their worker is dead), taken over
  local mine = {}
  local reply = redis.call('XAUTOCLAIM', key, group, consumer, min_idle, '0-0', 'COUNT', want, 'JUSTID')
  for _, id in ipairs(reply[2]) do
    local row = redis.call('XPENDING', key, group, id, id, 1)[1]
    local n = (row and row[4] or 0) + 1
    redis.call('XCLAIM', key, group, consumer, 0, id, 'RETRYCOUNT', n, 'JUSTID')
    local found = redis.call('XRANGE', key, id, id)[1]
    mine[#mine + 1] = {id, found and found[2] or false, n}
  end
  for _, id in ipairs(reply[3] or {}) do  -- Redis 7: deleted while pending, already dropped from the PEL
    mine[#mine + 1] = {id, false, 1}
  end
  want = want - #mine
  return mine
end
local claimed = {}
if min_idle > 0 then  -- every stream's orphans before any new entry: our own lanes must not crowd out a dead owner's
  for index = 1, last_key do
    if want <= 0 then break end
    local mine = orphans(KEYS[index])
    if #mine > 0 then claimed[index] = mine end
  end
  for index, j in pairs(fair_at) do  -- tenants' streams read more than min_idle ago that may hold orphans
    local pending = KEYS[total + 2 * j]
    for _, tenant in ipairs(redis.call('ZRANGEBYSCORE', pending, '-inf', now - min_idle, 'LIMIT', 0, 64)) do
      if want <= 0 then break end
      local key = KEYS[index] .. ':t:' .. tenant
      local left = redis.pcall('XPENDING', key, group)
      if type(left) ~= 'table' or left.err or left[1] == 0 then
        redis.call('ZREM', pending, tenant)
      else
        local mine = orphans(key)
        if #mine > 0 then table.insert(out, {key, {}, mine}) end
        redis.call('ZADD', pending, now, tenant)  -- looked at: again once min_idle has passed
      end
    end
  end
end
-- @TAKE_HANDED (worker/hand_back.py): jobs other workers handed back, before new ones
-- Fair share (worker/fair.py): the band's backlogged tenants, lowest virtual token counter first. A tenant is
-- charged `charge` tokens per job over its weight when read; one newly backlogged (producers add it at -inf) is
-- placed at the band's virtual time, the counter last served, or at the lowest counter of the tenants backlogged if
-- that is higher (on a cluster workers add what tenants took in the other shards to this shard's counters, which
-- moves no virtual time here): no credit for the time it was idle. Taken from the
-- lowest up to the point where it would pass the next one (QUANTUM jobs at least). Each turn takes a job or drops a
-- tenant, at most 64 turns: a read costs the same with 3 tenants or 100,000.
-- A job may make room for itself on a full worker (worker/fair.py) only when its tenant had at most PREEMPT_BACKLOG
-- jobs waiting, all of them read (a long backlog's wait is its own doing, and backlogged tenants share by counters):
-- such entries are marked. A full worker's preempting look (preempt_ms > 0) reads at most one job, in the first band
-- (by priority) with backlogged tenants, and only if the worker gave that band rooms: of the PREEMPT_LOOK lowest
-- counters, the first tenant whose job may make room there with at most PREEMPT_BACKLOG jobs waiting, the next of
-- which has waited preempt_ms.
local QUANTUM = 4  -- jobs a turn may take past the next counter: fewer turns per job, shares off by 4 jobs at most
local PREEMPT_LOOK, PREEMPT_BACKLOG = 4, 32
local function waited(key, cutoff)  -- a few new entries only, the next at least as old as the cutoff?
  local ok, last = pcall(delivered, key)  -- no stream: nothing waits; no group yet: every entry is new
  if not ok then return false end
  local next = redis.call('XRANGE', key, '(' .. (last or '0-0'), '+', 'COUNT', PREEMPT_BACKLOG + 1)
  return #next > 0 and #next <= PREEMPT_BACKLOG and tonumber(string.match(next[1][1], '^(%d+)')) <= cutoff
end
local looked = false  -- a preempting look is over once a band with backlogged tenants was seen
local function fair_take(index, band, backlog, pending)
  local vt_key = backlog .. ':vt'
  local vt = tonumber(redis.call('GET', vt_key) or 0) or 0
  local moved = false
  local floor = nil
  local function counter(raw)  -- a score of -inf: newly backlogged, placed where the others are (below)
    if raw ~= '-inf' then return tonumber(raw) end
    if not floor then  -- the band's virtual time, or the lowest counter of the tenants backlogged if that is higher
      local low = redis.call('ZRANGEBYSCORE', backlog, '(-inf', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      floor = vt
      if #low > 0 then floor = math.max(vt, tonumber(low[2])) end
    end
    return floor
  end
  local function serve(tenant, score, n, few, alone)  -- read up to n of its jobs, charge it, drop it once it has none
    local w = weights[tenant] or 1
    local key = band .. ':t:' .. tenant
    local reply = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', key, '>')
    if type(reply) == 'table' and reply.err and string.find(reply.err, 'NOGROUP') then
      redis.pcall('XGROUP', 'CREATE', key, group, '0')  -- producers leave groups to the first reader (none: no stream)
      reply = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', key, '>')
    end
    local entries = {}
    if type(reply) == 'table' and not reply.err and reply[1] then entries = reply[1][2] end
    if #entries > 0 then
      want = want - #entries
      few = few or (#entries <= PREEMPT_BACKLOG and (#entries < n or
                    redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1][1] == entries[#entries][1]))  -- drained
      table.insert(out, {key, entries, {}, few and 1 or 0, alone and 1 or 0})
      if redis.call('DECRBY', backlog .. ':queued', #entries) < 0 then redis.call('SET', backlog .. ':queued', 0) end
      redis.call('ZADD', pending, 'NX', now, tenant)
      if score ~= vt then vt, moved = score, true end  -- the lowest counter served: where newcomers start
    end
    if #entries < n then  -- no more new entries (or not a stream we can read): not backlogged now
      redis.call('ZREM', backlog, tenant)
    else
      redis.call('ZADD', backlog, score + #entries * charge / w, tenant)
    end
  end
  if preempt_ms > 0 then
    local low = redis.call('ZRANGE', backlog, 0, PREEMPT_LOOK - 1, 'WITHSCORES')
    looked = #low > 0
    local room = rooms[index]
    for i = 1, #low, 2 do
      if not room then break end
      if (room[low[i]] or room['']) > 0 and waited(band .. ':t:' .. low[i], now - preempt_ms) then
        serve(low[i], counter(low[i + 1]), 1, true, #low == 2)
        break
      end
    end
  else
    local turns = 0
    while want > 0 and turns < 64 do
      turns = turns + 1
      local low = redis.call('ZRANGE', backlog, 0, 1, 'WITHSCORES')
      if #low == 0 then break end
      local tenant, score = low[1], counter(low[2])
      local n = want
      if #low >= 4 then
        local gap = (counter(low[4]) - score) * (weights[tenant] or 1) / charge
        n = math.min(want, math.max(QUANTUM, math.floor(gap) + 1))
      end
      serve(tenant, score, n, false, #low == 2)
    end
  end
  if moved then redis.call('SET', vt_key, tostring(vt)) end
end
if overdue_age > 0 and now and preempt_ms == 0 then
  for index = last_key + 1, total do
    if want <= 0 then break end
    local key = KEYS[index]
    local entries = take(key, ripe(key, math.min(want, steal_max), now - overdue_age))
    steal_max = steal_max - #entries
    if #entries > 0 then table.insert(out, {key, entries, {}}) end
  end
end
for index = 1, last_key do
  local key, taken, entries = KEYS[index], claimed[index] or {}, {}
  if want > 0 and preempt_ms == 0 then
    local n = want
    if index > home then
      n = math.min(want, steal_max)
      if steal_age > 0 and now and index > urgent then n = ripe(key, n, now - steal_age) end
    end
    entries = take(key, n)
    if index > home then steal_max = steal_max - #entries end
  end
  if #entries > 0 or #taken > 0 then table.insert(out, {key, entries, taken}) end  -- lanes: most are empty
  local j = fair_at[index]
  if j and want > 0 and not looked then fair_take(index, key, KEYS[total + 2 * j - 1], KEYS[total + 2 * j]) end
end
local queued = {}  -- each fair band's jobs still queued after this read (its index in KEYS, then the count)
for index, j in pairs(fair_at) do
  queued[#queued + 1] = index
  queued[#queued + 1] = math.max(tonumber(redis.call('GET', KEYS[total + 2 * j - 1] .. ':queued') or 0) or 0, 0)
end
return {out, queued}
""".replace("-- @TAKE_HANDED (worker/hand_back.py): jobs other workers handed back, before new ones\n", TAKE_HANDED_LUA)

class StreamReply(NamedTuple):
    """One stream's part of the read script's reply, in its order: the one place it is taken apart."""

    stream: bytes
    new: list  # [id, fields] read new
    taken: list  # [id, fields or False, deliveries] taken over from a dead worker
    few: int = 0  # a tenant's stream: its jobs may make room for themselves (worker/fair.py)
    alone: int = 0  # a tenant's stream: its tenant was the only one backlogged in the band (Fair.read)
    handed: list = ()  # [id, fields or False, deliveries] another worker handed back (worker/hand_back.py)


class Entry(NamedTuple):
    """A job stream's entry as a read hands it over."""

    stream: str
    entry_id: str
    fields: dict | None  # None: gone (deleted or trimmed while pending)
    deliveries: int
    may_preempt: bool = False  # fair share: its tenant had few jobs waiting, so it may make room (worker/fair.py)
    alone: bool = False  # fair share: its tenant was the only one backlogged in its band: its charge stands (Fair.read)
    handed_back: bool = False  # taken from the hand-back index: read (and charged) before, by another look


@dataclass(slots=True)
class ReadPlan:
    """Which streams one read looks at and how (with lanes: made by `Affinity`, sized by the worker's refill)."""

    streams: list[str]  # priority by priority
    home: int | None = None  # with lanes: streams[:home] are ours, the rest are read only when ripe (stealing)
    urgent: int = 0  # with lanes: streams[home:home + urgent] are full owners' lanes, read without waiting to ripen
    overdue: list[str] = field(default_factory=list)  # others' lanes to check for overdue entries on this read
    overdue_ms: int = 0  # 0: never take others' entries before our own
    steal_max: int = 1  # entries one read may take from others' lanes
    fair: set[str] = field(default_factory=set)  # fair share: band streams whose tenants' streams are read after them
    charge: float = 1.0  # fair share: tokens a job read is charged (corrected when it ends)
    weights: dict[str, float] = field(default_factory=dict)  # fair share: tenant -> weight, where not 1
    preempt_ms: int = 0  # fair share, >0: a full worker's preempting look, for a job waiting this long (worker/fair.py)
    handed: bool = True  # takes jobs workers handed back first (worker/hand_back.py); not a read of tails that fit
    # fair share, that look: per band, what the worker runs there (worker/fair.py), for the bands it may preempt in
    occupancy: dict[str, Occupancy] = field(default_factory=dict)

    def urgent_streams(self) -> list[str]:
        return self.streams[self.home:self.home + self.urgent] if self.home is not None else []


@dataclass(slots=True)
class ShardCall:
    """One shard's read script call: its KEYS and ARGV (ARGV[3], the jobs wanted, set per call)."""

    shard: int
    keys: list[str]
    args: list


@dataclass(slots=True)
class ShardGroup:
    """A plan's streams in one shard, as one read script there looks at them."""

    shard: int
    streams: list[str]  # in plan order
    home: int  # how many lead as ours
    urgent: int = 0  # how many follow those as full owners' lanes
    overdue: list[str] = field(default_factory=list)  # others' lanes to check for overdue entries


@dataclass(slots=True)
class ReadSlot:
    """A read queued on a shared pipeline: its one reply parsed into entries when the round trip settles (and on
    a cluster, what its shard's fair bands still hold told to the reader's ShardTurns)."""

    entries: list[Entry] = field(default_factory=list)
    seen: Callable[[list], None] | None = None  # told the reply's queued counts

    def take(self, replies: Iterator) -> None:
        reply = next(replies)
        self.entries = Reader.parse(reply)
        if self.seen is not None:
            self.seen(reply)


@dataclass(slots=True)
class ShardTurns:
    """On a Redis Cluster with fair share, which shard the next one-shard read looks at: in turn, each as often as
    the jobs queued in its fair bands of the highest priority that has any (as the last read of it saw them; one
    never read counts as the fullest), by smooth weighted round robin, so the shards run dry together. Read in equal
    turns, a shard that held more (a tenant alone for a moment drained the others first; a tenant served the more in
    the shards where its backlog was, once it ran out in others) kept its tenants' jobs to the end, when they sat in
    a few shards whose turns of the fleet's reads were less than their share (W-FAIR's last window on a cluster).
    Each shard gets at least a quarter of an equal turn, so a job that lands in an emptier shard waits at most
    about four times the turn it would have had."""

    queued: dict[int, dict[str, int]] = field(default_factory=dict)  # shard -> priority -> jobs queued there
    credit: dict[int, float] = field(default_factory=dict)

    def saw(self, shard: int, by_priority: dict[str, int]) -> None:
        self.queued[shard] = by_priority

    def weights(self, shards: list[int]) -> dict[int, float]:
        top = next((p for p in PRIORITIES if any(self.queued.get(s, {}).get(p) for s in shards)), None)
        if top is None:
            return {s: 1.0 for s in shards}
        known = {s: self.queued[s].get(top, 0) for s in shards if s in self.queued}
        fullest = max(known.values())
        each = {s: known.get(s, fullest) for s in shards}
        floor = max(1.0, sum(each.values()) / (4 * len(shards)))
        return {s: max(float(n), floor) for s, n in each.items()}

    def next(self, shards: list[int]) -> int:
        """The shard to read next among `shards` (in the order that breaks ties)."""
        weights = self.weights(shards)
        for s in shards:
            self.credit[s] = self.credit.get(s, 0.0) + weights[s]
        pick = max(shards, key=lambda s: self.credit[s])
        self.credit[pick] -= sum(weights.values())
        return pick


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
    turns: ShardTurns = field(default_factory=ShardTurns)  # a cluster, fair share: the shards' turns by their backlog
    handed_grace_ms: int = 0  # with keys: how long entries we handed back are left to others (worker/hand_back.py)

    def __post_init__(self) -> None:
        self.script = self.client.register_script(READ_LUA)

    def order(self) -> list[str]:
        streams = self.plan.streams
        n, shift = self.per_priority, self.turn % self.per_priority
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
        share (W-FAIR on a cluster)."""
        out: list[Entry] = []
        calls = self._scripts(count, plan, reclaim_idle_ms)
        again = []
        for i, call in enumerate(calls):
            if len(out) >= count:
                break
            call.args[2] = -(-(count - len(out)) // (len(calls) - i))
            got = self._run(call)
            out += got
            if len(got) == call.args[2] and i < len(calls) - 1:
                again.append(call)
        for call in again:
            if len(out) >= count:
                break
            call.args[2] = count - len(out)
            out += self._run(call)
        return out

    def _run(self, call: ShardCall) -> list[Entry]:
        reply = run_script(self.script, call.keys, call.args, self.client)
        self._seen(call, reply)
        return self.parse(reply)

    def _seen(self, call: ShardCall, reply) -> None:
        """What the read's shard still queues in its fair bands, per priority, for the shards' turns."""
        if len(self.keys.parts if self.keys else ()) > 1:
            flat = reply[1]
            by_priority: dict[str, int] = {}
            for index, n in zip(flat[::2], flat[1::2]):
                priority = Keys.band_priority(call.keys[int(index) - 1])
                by_priority[priority] = by_priority.get(priority, 0) + int(n)
            self.turns.saw(call.shard, by_priority)

    def queue(self, pipe, count: int, plan: ReadPlan, reclaim_idle_ms: int = 0) -> ReadSlot:
        """The same read queued on `pipe`; on a cluster it looks at one shard, so priority holds within a shard
        and the shards take turns."""
        call = self._scripts(count, plan, reclaim_idle_ms)[0]
        run_script(self.script, call.keys, call.args, pipe)
        return ReadSlot(seen=lambda reply: self._seen(call, reply))

    def _scripts(self, count: int, plan: ReadPlan | None, reclaim_idle_ms: int) -> list[ShardCall]:
        """Each shard's script call, in the order this read takes the shards: in turn, one further each time; with
        fair share (but for a preempting look), the first by the shards' backlogs (ShardTurns)."""
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
        if plan.fair and not plan.preempt_ms and len(order) > 1:
            first = self.turns.next([g.shard for g in order])
            order.sort(key=lambda g: g.shard != first)
        calls = []
        for group in order:
            keys, others = group.streams, group.overdue
            handed = self.keys is not None and plan.handed
            args = [Keys.GROUP, self.consumer, count, reclaim_idle_ms, self.handed_grace_ms if handed else -1]
            bands = [i + 1 for i, st in enumerate(keys) if st in plan.fair]
            if plan.home is not None:
                args += [group.home, self.steal_age_ms, plan.overdue_ms, len(others), plan.steal_max, group.urgent]
            elif bands:
                args += [len(keys), 0, 0, 0, count, 0]
            if bands:
                triples = [(i, t or "", int(here.makes_room(t))) for i in bands if (here := plan.occupancy.get(keys[i - 1]))
                           is not None for t in (None, *here.counts)]
                args += [len(bands), plan.charge, plan.preempt_ms, len(triples), *(x for t in triples for x in t),
                         *bands, *(x for t, w in plan.weights.items() for x in (t, w))]
                others = others + [k for i in bands for k in (Keys.fair_backlog(keys[i - 1]),
                                                                   Keys.fair_pending(keys[i - 1]))]
            index = [self.keys.handed_back(group.shard)] if handed else []
            calls.append(ShardCall(group.shard, keys + others + index, args))
        return calls

    def _by_shard(self, plan: ReadPlan, streams: list[str], overdue: list[str]) -> list[ShardGroup]:
        """The plan's streams shard by shard (one group on a single Redis)."""
        home = len(streams) if plan.home is None else plan.home
        if self.keys is None or len(self.keys.parts) == 1:
            return [ShardGroup(0, streams, home, plan.urgent, overdue)]
        groups: dict[int, ShardGroup] = {}
        for i, stream in enumerate(streams):
            shard = self.keys.of_stream(stream).shard
            g = groups.setdefault(shard, ShardGroup(shard, [], 0))
            g.streams.append(stream)
            g.home += i < home
            g.urgent += home <= i < home + plan.urgent
        for stream in overdue:
            shard = self.keys.of_stream(stream).shard
            groups.setdefault(shard, ShardGroup(shard, [], 0)).overdue.append(stream)
        return [groups[k] for k in sorted(groups)]

    @staticmethod
    def parse(reply) -> list[Entry]:
        out: list[Entry] = []
        for row in reply[0]:
            r = StreamReply(*row)
            stream = as_text(r.stream)
            out += [Entry(stream, as_text(i), _pairs(f), n, handed_back=True) for i, f, n in r.handed]
            out += [Entry(stream, as_text(i), _pairs(f), n) for i, f, n in r.taken]
            out += [Entry(stream, as_text(i), _pairs(f), 1, bool(r.few), bool(r.alone)) for i, f in r.new]
        return out


def _pairs(flat: list | None) -> dict | None:
    return dict(zip(flat[::2], flat[1::2])) if flat else None
