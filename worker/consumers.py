"""Consumer hygiene: a worker that leaves must not stay a consumer of the job streams' group forever.

XGROUP DELCONSUMER drops the consumer's pending entries with it, and an entry dropped that way is never delivered
again: so a consumer goes only when it holds nothing, checked and deleted in one script. A worker deletes its own
consumer on a clean exit; any live worker's housekeeping deletes those idle past the reclaim timeout with no live
heartbeat (crashed workers, whose pending entries reclaim has already moved away). These are the shared streams' and
lanes'; tenants' streams (fair share) are pruned by fair.py's pass, a bounded slice of them at a time. The shared
streams too are pruned PRUNE_STREAMS a pass, in turns from a place of the worker's own: with LoRA adapters a worker
reads three streams an adapter (600 for 200), and all of them each trim, on a fleet of workers started together,
held Redis 15 ms per worker every five seconds, so every step of the fleet stalled for a quarter of a second (W-LORA's
fleet). A departed consumer holds nothing (or it would not go), so a slower sweep costs nothing but a listing.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import redis

from kvgate.producer.keys import Keys, as_text

PRUNE_STREAMS = 64  # streams a prune pass looks at; the next pass goes on from there

# KEYS: job streams of one shard; ARGV: group, min idle ms, heartbeat key prefix, our own consumer (never pruned).
# On a Redis Cluster the heartbeats are in another slot, which a script may not touch, and listing them would take a
# SCAN of every node's whole keyspace per worker and housekeeping: there the prefix is empty and the heartbeat is not
# asked. That is safe: a consumer goes only with nothing pending (checked here, atomically), and a live worker's
# next read creates its consumer again; a live worker is rarely idle that long anyway (it reads every shard often).
PRUNE_LUA = """
local function alive(name)
  return ARGV[3] ~= '' and redis.call('EXISTS', ARGV[3] .. name) == 1
end
local gone = {}
for _, key in ipairs(KEYS) do
  local ok, rows = pcall(redis.call, 'XINFO', 'CONSUMERS', key, ARGV[1])
  if ok then
    for _, row in ipairs(rows) do
      local c = {}
      for i = 1, #row, 2 do c[row[i]] = row[i + 1] end
      if c['pending'] == 0 and c['idle'] >= tonumber(ARGV[2]) and c['name'] ~= ARGV[4]
          and not alive(c['name']) then
        redis.call('XGROUP', 'DELCONSUMER', key, ARGV[1], c['name'])
        gone[#gone + 1] = c['name']
      end
    end
  end
end
return gone
"""
# KEYS: job streams; ARGV: group, consumer. Deletes the consumer where it holds nothing; returns where it could not.
RETIRE_LUA = """
local kept = {}
for _, key in ipairs(KEYS) do
  local ok, rows = pcall(redis.call, 'XPENDING', key, ARGV[1], '-', '+', 1, ARGV[2])
  if ok then
    if #rows == 0 then
      redis.call('XGROUP', 'DELCONSUMER', key, ARGV[1], ARGV[2])
    else
      kept[#kept + 1] = key
    end
  end
end
return kept
"""


@dataclass(slots=True)
class Consumers:
    client: redis.Redis
    keys: Keys
    consumer: str
    streams: list[str]
    min_idle_ms: int
    prune_script: object = None
    retire_script: object = None
    prune_at: int = field(default_factory=lambda: random.randrange(1 << 16))  # where the next pass starts

    def __post_init__(self) -> None:
        self.prune_script = self.client.register_script(PRUNE_LUA)
        self.retire_script = self.client.register_script(RETIRE_LUA)

    def create_groups(self, streams: list[str]) -> None:
        """One round trip for all of them: with lanes a worker reads hundreds of streams."""
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
        for reply in pipe.execute(raise_on_error=False) if streams else []:
            if isinstance(reply, redis.ResponseError) and "BUSYGROUP" not in str(reply):
                raise reply

    def add(self, streams: list[str]) -> list[str]:
        """Streams that join those we read (lanes learnt, LoRA adapters registered since; the list only grows): their
        groups made, onto the worker's list (ours is the same list); returned."""
        self.create_groups(streams)
        self.streams += streams
        return streams

    def prune(self) -> list[str]:
        """Delete departed consumers (idle, nothing pending, no heartbeat) of the next PRUNE_STREAMS streams (all of
        them when they are no more); returns their names."""
        args = [Keys.GROUP, self.min_idle_ms, "" if self.keys.cluster else self.keys.worker(""), self.consumer]
        gone = set()
        for streams in self.keys.by_shard(self.next_streams()):
            gone |= {as_text(n) for n in self.prune_script(keys=streams, args=args)}
        return sorted(gone)

    def next_streams(self) -> list[str]:
        """The streams of the next prune pass: PRUNE_STREAMS of them, on from the last pass's."""
        if len(self.streams) <= PRUNE_STREAMS:
            return list(self.streams)
        start = self.prune_at % len(self.streams)
        self.prune_at = start + PRUNE_STREAMS
        return (self.streams[start:] + self.streams[:start])[:PRUNE_STREAMS]

    def retire(self) -> list[str]:
        """Delete our own consumer where we hold nothing; returns the streams where entries still wait on us
        (handed back: others reclaim them, then prune us)."""
        return [as_text(k) for streams in self.keys.by_shard(self.streams)
                for k in self.retire_script(keys=streams, args=[Keys.GROUP, self.consumer])]
