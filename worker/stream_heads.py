"""The heads of job streams: for each, how many of its jobs no worker runs yet and since when the oldest of them waits.

A job waits in one of two places: new in its stream, past the workers' group's last delivered entry (the group's lag
tells how many), or parked in the stream's due index for deadline order (worker/due.py: delivered to no worker that
runs it, taken by any reader of the stream earliest due first). A look at the first place alone saw an adapter's
parked jobs as none: in W-LORA's fleet the hottest adapters' last jobs, parked 64 at a time, were served only by the
few workers holding the adapter while the others stood idle (worker/adapters.py reads only adapters it sees waiting).

One script a shard, its inputs by name (ARGV[1], JSON: group, and streams [{key, due}], each its KEYS index), its
reply one JSON array of {stream, since (server ms), count} for the streams with jobs waiting."""
from __future__ import annotations

import json
from dataclasses import dataclass

import redis

from kvgate.producer.cluster import run_script
from kvgate.producer.keys import Keys

HEADS_LUA = """
local input = cjson.decode(ARGV[1])
local out = {}
for _, s in ipairs(input.streams) do
  local key, since, count = KEYS[s.key], nil, 0
  -- most of a fleet's streams hold nothing (other priorities, idle adapters): XLEN is cheap where XINFO is not; an
  -- empty stream, a missing key or one of another type has no new job waiting
  local after, lag = '0-0', 0
  local ok, length = pcall(redis.call, 'XLEN', key)
  if ok and length > 0 then
    lag = nil  -- our group's, where XINFO tells it
    local found, groups = pcall(redis.call, 'XINFO', 'GROUPS', key)
    for _, g in ipairs(found and groups or {}) do
      local f = {}
      for j = 1, #g, 2 do f[g[j]] = g[j + 1] end
      if f['name'] == input.group then after, lag = f['last-delivered-id'], f['lag'] end
    end
  end
  if lag ~= 0 then  -- nil or false where the server does not tell (Redis 6.2, entries deleted): 1 at least
    local first = redis.call('XRANGE', key, '(' .. after, '+', 'COUNT', 1)
    if #first > 0 then
      since, count = tonumber(string.match(first[1][1], '^(%d+)-')), lag or 1
    end
  end
  local parked = redis.call('ZCARD', KEYS[s.due])
  if parked > 0 then  -- the earliest due: for jobs without deadlines, the first to arrive (a member's first 16 digits)
    local ms = tonumber(string.sub(redis.call('ZRANGE', KEYS[s.due], 0, 0)[1], 1, 16))
    since, count = math.min(since or ms, ms), count + parked
  end
  if since then out[#out + 1] = {stream = key, since = since, count = count} end
end
if #out == 0 then return '[]' end
return cjson.encode(out)
"""


@dataclass(slots=True)
class Head:
    since_ms: int  # when the oldest waiting job arrived (server ms)
    count: int  # jobs waiting, new and parked (at least 1)


class StreamHeads:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client, self.keys = client, keys
        self.script = client.register_script(HEADS_LUA)
        self.named: tuple[list[str], list[tuple[list[str], str]]] = ([], [])  # streams -> each shard's keys, inputs

    def look(self, streams: list[str]) -> dict[str, Head]:
        """The streams with jobs waiting, and their heads."""
        if self.named[0] != streams:  # named once per change of the streams looked at (every heartbeat otherwise)
            self.named = (list(streams), [self._call(group) for group in self.keys.by_shard(streams)])
        heads: dict[str, Head] = {}
        for keys, inputs in self.named[1]:
            reply = json.loads(run_script(self.script, keys, [inputs], self.client))
            heads.update({row["stream"]: Head(int(row["since"]), int(row["count"])) for row in reply})
        return heads

    def _call(self, streams: list[str]) -> tuple[list[str], str]:
        keys: list[str] = []

        def add(key: str) -> int:
            keys.append(key)
            return len(keys)

        named = [{"key": add(s), "due": add(self.keys.due_index(s))} for s in streams]
        return keys, json.dumps({"group": Keys.GROUP, "streams": named}, separators=(",", ":"))
