"""Handing back a job read that does not fit here, so another worker's next read takes it at once.

A small worker reads by an estimate of a job's size; a job that turns out bigger than its room, that cannot make room
either (its tenant at its share here, or the jobs that would give way freeing too little: worker/fair.py), waited on
that worker for its running jobs to end while others had room (issue 45: 0.3-1.6 s in W-FAIR). After hand_back_ms
(worker settings) in the local queue it goes back: still pending to us, listed in its shard's hand-back index
(Keys.handed_back), which every worker's read script (worker/reader.py) takes from before new entries, by a JUSTID
claim: no delivery is counted, and its tenant's read charge stands (a takeover is not charged again: Refill._took_fair).
The giver keeps its lease until another takes it (so no reclaim counts a delivery for it), skips it for a grace period
(so another gets it first; a lone worker still serves it then), and hands a job back at most once: two small workers
pass it back and forth no more than twice, then one of them waits for room as before.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import redis

from kvgate.producer.cluster import run_script
from kvgate.producer.keys import Keys, as_text
from kvgate.worker.admission import Ticket

log = logging.getLogger("kvgate.worker")
GRACE_TIMES = 3  # the giver skips its own handed-back entry for this many hand_back_ms: others' reads come first
GIVEN_KEPT = 4096  # jobs remembered as handed back once (a job is handed back at most once per worker)
# KEYS[1]: the shard's hand-back index; ARGV: group, consumer, then stream/entry id pairs. Lists each entry still
# pending to us, its lease renewed; returns the `stream|id` of those that are not (taken over or acknowledged).
HAND_BACK_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lost = {}
for i = 3, #ARGV - 1, 2 do
  local key, id = ARGV[i], ARGV[i + 1]
  local ok, rows = pcall(redis.call, 'XPENDING', key, ARGV[1], id, id, 1)
  if ok and rows[1] and rows[1][2] == ARGV[2] then
    redis.call('XCLAIM', key, ARGV[1], ARGV[2], 0, id, 'JUSTID')
    redis.call('ZADD', KEYS[1], now, ARGV[2] .. '\\n' .. id .. '\\n' .. key)
  else
    lost[#lost + 1] = key .. '|' .. id
  end
end
return lost
"""
# The read script's part (worker/reader.py READ_LUA, after the reclaim, before new entries; its locals there; `handed`:
# the index, from `input.handed`, with `grace`, hand_back_inputs): the
# oldest few listed entries of the streams this read may take from (ours and their tenants' streams), each still pending
# to the worker that listed it, claimed with JUSTID (no delivery counted; its count goes with it), or dropped from the
# index where acknowledged or taken over since; an entry we listed only once our grace has passed.
TAKE_HANDED_LUA = """
if handed and want > 0 and preempt_ms == 0 then  -- jobs workers handed back, before new ones
  local ours = {}  -- the streams this read may take from: ours and their tenants' streams
  for _, stream in ipairs(streams) do ours[KEYS[stream.key]] = true end
  local got = {}
  local listed = redis.call('ZRANGE', handed, 0, 31, 'WITHSCORES')  -- the oldest few: a read's cost stays flat
  for i = 1, #listed, 2 do
    if want <= 0 then break end
    local giver, id, key = string.match(listed[i], '^([^\\n]*)\\n([^\\n]*)\\n(.*)$')
    if key and (ours[key] or ours[string.match(key, '^(.*):t:[^:]*$') or '']) then
      local ok, rows = pcall(redis.call, 'XPENDING', key, group, id, id, 1)
      if not (ok and rows[1] and rows[1][2] == giver) then  -- acknowledged, or taken over since: not handed back now
        redis.call('ZREM', handed, listed[i])
      elseif giver ~= consumer or now - tonumber(listed[i + 1]) >= grace then  -- the giver's own: after the grace
        redis.call('XCLAIM', key, group, consumer, 0, id, 'JUSTID')  -- counts no delivery
        redis.call('ZREM', handed, listed[i])
        local found = redis.call('XRANGE', key, id, id)[1]
        got[key] = got[key] or {}
        table.insert(got[key], {id, found and found[2] or false, rows[1][4]})
        want = want - 1
      end
    end
  end
  for key, mine in pairs(got) do table.insert(out, {'stream', key, 'handed', mine}) end
end
"""


def hand_back_inputs(index: int, grace: int) -> dict:
    """The read script's hand-back inputs (`input.handed`): the index's place in its KEYS, and the grace in ms in
    which entries we handed back are left to others."""
    return {"key": index, "grace": grace}


def grace_ms(after_ms: int) -> int:
    """How long the giver's own reads skip an entry it handed back (the read script, worker/reader.py)."""
    return GRACE_TIMES * after_ms


@dataclass(slots=True)
class HandBack:
    """Our jobs handed back and not yet taken: their leases are ours to renew until another worker takes them."""

    client: redis.Redis
    keys: Keys
    consumer: str
    after_ms: int  # in the local queue this long without fitting: handed back (0: never)
    waiting: dict[str, tuple[str, str]] = field(default_factory=dict)  # `stream|id` -> (stream, id), not yet taken
    given: dict[str, None] = field(default_factory=dict)  # `stream|id` of jobs handed back once, oldest first
    script: object = None

    def __post_init__(self) -> None:
        self.script = self.client.register_script(HAND_BACK_LUA)

    def due(self, ticket: Ticket) -> bool:
        """Whether a job that does not fit here and cannot make room goes back now: it waited here after_ms, and
        was never handed back by us (one we took back waits here for room)."""
        return (self.after_ms > 0 and ticket.key not in self.given
                and (time.monotonic() - ticket.queued_at) * 1000 >= self.after_ms)

    def give(self, tickets: list[Ticket]) -> None:
        """List these jobs (still pending to us) in their shards' hand-back index, one script per shard."""
        for group in self.keys.by_shard(tickets, lambda t: t.stream):
            for ticket in group:  # once, even if Redis refuses now
                self._remember(ticket.key)
            args = [Keys.GROUP, self.consumer, *(x for t in group for x in (t.stream, t.entry_id))]
            shard = self.keys.of_stream(group[0].stream).shard
            lost = {as_text(k) for k in run_script(self.script, [self.keys.handed_back(shard)], args, self.client)}
            for ticket in group:
                if ticket.key not in lost:
                    self.waiting[ticket.key] = (ticket.stream, ticket.entry_id)

    def give_one(self, ticket: Ticket) -> bool:
        """Hand back a job that does not fit here; False: Redis refused, so it waits here for room (it is handed back
        at most once: no retry each pass)."""
        try:
            self.give([ticket])
        except redis.RedisError as e:
            log.warning("could not hand back job %s (%s: %s); it waits here for room", ticket.key,
                        e.__class__.__name__, e)
            return False
        log.debug("handed back job %s: it does not fit here", ticket.key)
        return True

    def _remember(self, key: str) -> None:
        self.given[key] = None
        while len(self.given) > GIVEN_KEPT:
            del self.given[next(iter(self.given))]

    def add_to(self, entries: dict[str, list[str]]) -> dict[str, list[str]]:
        """`entries` (entry ids by stream, as leases.entries_of gives our jobs') with ours waiting in the index added:
        their leases are renewed with our running jobs', and a drain hands them back with the queued ones."""
        for stream, entry_id in self.waiting.values():
            entries.setdefault(stream, []).append(entry_id)
        return entries

    def settle(self, keys) -> set[str]:
        """These `stream|id` keys were read by us or found no longer ours: not ours to renew any more. Returns the
        others (jobs we ran that someone took over)."""
        return {key for key in keys if self.waiting.pop(key, None) is None}

    def take_all(self, entries: dict[str, list[str]]) -> dict[str, list[str]]:
        """Draining: `entries` with every one of ours still waiting in the index, forgotten here."""
        out = self.add_to(entries)
        self.waiting.clear()
        return out
