"""Job-stream hygiene: trim only entries that every consumer group has acknowledged.

The safe floor is the smallest id still pending in any group, or, where nothing is pending, the entry
after the group's last delivered one. A script per stream computes it and trims on the server, atomically, and
one pipeline carries the scripts of every stream a worker reads: with affinity lanes that is hundreds of streams,
and a round trip or three for each, every few seconds on every worker, cost the fleet's engine threads more CPU
than their reads (W-PREFIX). One key per script keeps each call in one slot of a Redis Cluster.
"""
from __future__ import annotations

import redis

from kvgate.producer.cluster import run_script

# KEYS[1] a job stream. Returns how many entries went. Ids compare as (ms, seq) pairs of Lua numbers: exact below 2^53.
TRIM_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('XLEN', KEYS[1]) == 0 then return 0 end
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local fms, fseq = nil, nil
local function lower(ms, seq)
  if fms == nil or ms < fms or (ms == fms and seq < fseq) then fms, fseq = ms, seq end
end
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local f = {}
  for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
  local ms, seq = parse(f['last-delivered-id'])
  lower(ms, seq + 1)
  if f['pending'] > 0 then
    local oldest = redis.call('XPENDING', KEYS[1], f['name'])[2]
    if oldest then lower(parse(oldest)) end
  end
end
if fms == nil or (fms == 0 and fseq <= 1) then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', string.format('%d-%d', fms, fseq))
"""


def trim(client: redis.Redis, streams: list[str]) -> int:
    """Remove acknowledged entries below each stream's floor, all streams in one round trip; how many went."""
    if not streams:
        return 0
    script = client.register_script(TRIM_LUA)
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        run_script(script, [stream], [], pipe)
    return sum(n for n in pipe.execute(raise_on_error=False) if isinstance(n, int))
