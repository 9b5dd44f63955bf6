"""Pruning tenants' streams (fair share, worker/fair.py): a bounded slice of each band's streams index per pass.

Tenants' streams that exist sit in `<band>:fair:streams`, which the pruning pass walks a bounded slice at a time,
oldest look first: it deletes streams left empty and the departed consumers of the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import redis

from kvgate.producer.cluster import run_script
from kvgate.producer.keys import ID_AFTER_LUA, Keys, as_text

SWEEP_TENANTS = 64  # tenants' streams one pruning pass looks at per band, the longest unseen first
# After a pass whose slice was full in some band (more may be due now), the next pass comes this soon rather than a
# trim interval later: a drain of 50,000 tenants left 48,465 emptied streams (84 MB) for an hour at one slice per
# 5 s. It costs little more: a stream the pass keeps is looked at again only once min idle (the reclaim timeout) has
# passed, so the fleet's looks stay at most one per stream and reclaim timeout, plus one per stream deleted; only a
# full slice brings the next pass forward, so an idle namespace still costs one pass per trim interval.
SWEEP_AGAIN_S = 0.1

# KEYS: per band (one shard's bands) its streams index, backlog and pending index; ARGV: group, min idle ms, heartbeat
# key prefix ('' on a cluster: see consumers.py), our own consumer, tenants per band, then the bands. Per band, the
# tenants whose stream was last looked at over min idle ago (or never), at most SWEEP_TENANTS: a stream gone (or not
# a stream) is forgotten; one with nothing pending, nothing undelivered and its tenant not backlogged is deleted
# (in this script, in the band's slot, so a producer's XADD cannot slip in between the look and the DEL: its
# next job makes the stream again and joins the index anew, and a reader makes the group on NOGROUP); in any other
# its departed consumers (idle, nothing pending, no heartbeat) are deleted, as consumers.py does for the shared
# streams, and it is looked at again once min idle has passed. Returns {streams deleted, consumers deleted, 1 if some
# band's slice was full (more may be due) else 0}.
SWEEP_LUA = ID_AFTER_LUA + """
local group, min_idle, prefix, me = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local limit = tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deleted, gone, full = 0, {}, 0
for b = 1, #ARGV - 5 do
  local band, known, backlog, pending = ARGV[5 + b], KEYS[3 * b - 2], KEYS[3 * b - 1], KEYS[3 * b]
  local slice = redis.call('ZRANGEBYSCORE', known, '-inf', now - min_idle, 'LIMIT', 0, limit)
  if #slice >= limit then full = 1 end
  for _, tenant in ipairs(slice) do
    local key = band .. ':t:' .. tenant
    local kind = redis.call('TYPE', key)['ok']
    if kind ~= 'stream' then
      redis.call('ZREM', known, tenant)
    else
      local g = nil
      for _, row in ipairs(redis.call('XINFO', 'GROUPS', key)) do
        local f = {}
        for i = 1, #row, 2 do f[row[i]] = row[i + 1] end
        if f['name'] == group then g = f end
      end
      local top = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
      local waiting = top ~= nil and (g == nil or id_after(top[1], g['last-delivered-id']))
      if not waiting and (g == nil or g['pending'] == 0) and not redis.call('ZSCORE', backlog, tenant) then
        redis.call('DEL', key)
        redis.call('ZREM', known, tenant)
        redis.call('ZREM', pending, tenant)
        deleted = deleted + 1
      else
        if g ~= nil then
          for _, row in ipairs(redis.call('XINFO', 'CONSUMERS', key, group)) do
            local c = {}
            for i = 1, #row, 2 do c[row[i]] = row[i + 1] end
            if c['pending'] == 0 and c['idle'] >= min_idle and c['name'] ~= me
                and not (prefix ~= '' and redis.call('EXISTS', prefix .. c['name']) == 1) then
              redis.call('XGROUP', 'DELCONSUMER', key, group, c['name'])
              gone[#gone + 1] = c['name']
            end
          end
        end
        redis.call('ZADD', known, now, tenant)
      end
    end
  end
end
return {deleted, gone, full}
"""



@dataclass(slots=True, frozen=True)
class Swept:
    """What one pruning pass over the tenants' streams deleted."""

    deleted: int = 0  # tenants' streams left empty
    consumers: list[str] = field(default_factory=list)  # departed consumers' names (each once)
    more: bool = False  # some band's slice was full: more streams may be due now (SWEEP_AGAIN_S)


@dataclass(slots=True)
class Sweeper:
    """The pruning pass over the tenants' streams of a worker's bands (SWEEP_LUA, registered at its first use)."""

    client: redis.Redis
    keys: Keys
    script: object = None

    def sweep(self, bands: set[str], min_idle_ms: int, consumer: str) -> Swept:
        """Delete the tenants' streams left empty and the departed consumers of the others, a bounded slice of each
        band's streams index per call: one script per shard, whatever the tenants."""
        if self.script is None:
            self.script = self.client.register_script(SWEEP_LUA)
        prefix = "" if self.keys.cluster else self.keys.worker("")
        deleted, gone, more = 0, set(), False
        for group in self.keys.by_shard(sorted(bands)):
            keys = [k for band in group
                    for k in (Keys.fair_streams(band), Keys.fair_backlog(band), Keys.fair_pending(band))]
            args = [Keys.GROUP, min_idle_ms, prefix, consumer, SWEEP_TENANTS, *group]
            n, names, full = run_script(self.script, keys, args, self.client)
            deleted, more = deleted + int(n), more or bool(full)
            gone |= {as_text(name) for name in names}
        return Swept(deleted, sorted(gone), more)
