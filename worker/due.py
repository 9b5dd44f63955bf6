"""Deadline order: within a stream (one priority of one model, or one lane of it), jobs are served earliest deadline
first.

Redis Streams hand out new entries only in id order, and a claim moves only pending entries, so the read script keeps
a bounded reorder window per stream: it reads up to `window` new entries under a consumer no worker can be
(Keys.PARKED), lists them in the stream's due index (Keys.due_index) scored by when each is due on the server's clock
(entry ms + the job's relative deadline in ms, the entry's DUE_FIELD; a job with none is due when it arrived, so jobs
without deadlines keep their FIFO order and are never starved by later ones with deadlines), and hands the reading
worker the earliest due of them with a JUSTID claim: no delivery is counted (parking counted the one). Ties go by id
(the index's members are zero-padded ids). A job with a deadline further off than a later job's waits behind it only
while both are parked: order beyond the window is the stream's.

A parked entry is pending to PARKED, so every reader of the group's pending entries must tell parked from running: the
reclaim here skips parked entries that are in the index (one missing from it, stranded, is taken over as an orphan),
`job_status` says `queued` for them, and queue stats count them as waiting (lag + the index's size). Trimming keeps
them (they are pending). Under fair share a tenant's stream has its own window and index, beside its band's (fair.py takes
through `take`). A worker with deadline order off (`window` 0) parks nothing but still takes from the index
first, so a fleet that mixes the setting, or turns it off, strands nothing.

Affinity lanes (affinity.py) have a window and an index each, as the shared streams do, and every read of a lane names
its index: the owner's, a thief's, an overdue check's and a reclaim's. A parked entry is delivered, so a look past the
group's last delivered id would miss it: a thief's ripeness look (is a job in another's lane older than the steal age,
or overdue?) counts the lane's parked entries by when they arrived (`parked_by`) before its new ones, and then takes
as many as are ripe, earliest due first. So a busy, stalled or killed owner's parked entries are taken as its new ones
were: by thieves once ripe, and by the lane's next owner as its own once the ring moves the lane (a reclaim skips them,
as everywhere: they are no dead worker's).
"""
from __future__ import annotations

from kvgate.producer.keys import Keys
from kvgate.producer.protocol import DUE_FIELD

# The read script's part (worker/reader.py READ_LUA; its locals there): `take`, `orphans` and `parked_by` for the
# streams whose index the inputs name (`stream.due`, or an overdue lane's `due` in `input.lanes.overdue`: its KEYS
# index; `input.due`: {window, holder, field}); other streams are read as before. Replaces the plain XREADGROUP and
# the reclaim's XAUTOCLAIM, which would take parked entries for orphans.
DUE_READ_LUA = """
local due = input.due or {}
local window, holder, due_field = due.window or 0, due.holder or '', due.field or ''
local MAX_DUE_MS = 1e15  -- some 31,000 years
local index_of = {}  -- stream key -> its due index: the streams read, and others' lanes looked at for overdue jobs
for _, stream in ipairs(streams) do
  if stream.due then index_of[KEYS[stream.key]] = KEYS[stream.due] end
end
for _, lane in ipairs(input.lanes and input.lanes.overdue or {}) do
  if lane.due then index_of[KEYS[lane.key]] = KEYS[lane.due] end
end
local function index_for(key)  -- a stream's due index: named in the inputs, or a band's tenant's beside the band's
  local band, tenant = string.match(key, '^(.*):t:([^:]*)$')
  return index_of[key] or (band and index_of[band] and index_of[band] .. ':t:' .. tenant) or nil
end
local function pad(id)  -- a member whose order is the ids' order
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return string.rep('0', 16 - #ms) .. ms .. '-' .. string.rep('0', 20 - #seq) .. seq
end
local function unpad(member)
  local ms, seq = string.match(member, '^0*(%d+)-0*(%d+)$')
  return ms .. '-' .. seq
end
local function due_at(e)  -- when a new entry is due: its ms + its relative deadline (none: when it arrived)
  local f, rel = e[2], 0
  for i = 1, #f - 1, 2 do
    local v = f[i] == due_field and tonumber(f[i + 1])
    if v and v > 0 and v < MAX_DUE_MS then rel = v end  -- a producer's nan, inf or junk: no deadline
  end
  return tonumber(string.match(e[1], '^(%d+)')) + rel
end
local function park(key, index, n)  -- up to n new entries, read under the holder, listed by when each is due
  if n <= 0 then return end
  local reply = redis.call('XREADGROUP', 'GROUP', group, holder, 'COUNT', n, 'STREAMS', key, '>')
  for _, e in ipairs(reply and reply[1][2] or {}) do redis.call('ZADD', index, due_at(e), pad(e[1])) end
end
-- None parked: n + window new entries read for us, the earliest due n kept and the rest parked, so a stream the fleet
-- keeps up with costs one read and a sort, as without deadline order.
local function sorted_read(key, index, n)
  local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n + window, 'STREAMS', key, '>')
  local got, mine = reply and reply[1][2] or {}, {}
  for _, e in ipairs(got) do e[3], e[4] = pad(e[1]), due_at(e) end
  table.sort(got, function(a, b) return a[4] < b[4] or (a[4] == b[4] and a[3] < b[3]) end)
  for i, e in ipairs(got) do
    if i <= n then
      mine[i] = {e[1], e[2]}
    else
      redis.call('XCLAIM', key, group, holder, 0, e[1], 'JUSTID')  -- counts no delivery
      redis.call('ZADD', index, e[4], e[3])
    end
  end
  return mine
end
local function unpark(key, index, n)  -- up to n parked entries, earliest due first, claimed for us
  local got = {}
  if n <= 0 then return got end
  for _, member in ipairs(redis.call('ZRANGE', index, 0, n - 1)) do
    redis.call('ZREM', index, member)
    local id = unpad(member)
    local row = redis.call('XPENDING', key, group, id, id, 1)[1]
    if row and row[2] == holder then  -- else acknowledged or taken over since: not parked now
      redis.call('XCLAIM', key, group, consumer, 0, id, 'JUSTID')  -- counts no delivery
      local found = redis.call('XRANGE', key, id, id)[1]
      got[#got + 1] = {id, found and found[2] or false}
    end
  end
  return got
end
local function take(key, n)  -- up to n entries of a stream: with an index, earliest due first
  if n <= 0 then return {} end
  local index, entries = index_for(key), {}
  local parked = index and redis.call('ZCARD', index) or 0
  if index and window > 0 and parked == 0 then
    entries = sorted_read(key, index, n)
  elseif index then
    if window > 0 then park(key, index, window + n - parked) end
    entries = unpark(key, index, n)
  end
  if #entries < n and (window == 0 or not index) then  -- parked ones first; with a window every new one is parked
    local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n - #entries, 'STREAMS', key, '>')
    for _, e in ipairs(reply and reply[1][2] or {}) do entries[#entries + 1] = e end
  end
  want = want - #entries
  return entries
end
local function parked_by(key, n, cutoff)  -- how many of a stream's parked entries, at most n, arrived by the cutoff
  local index = index_for(key)
  if n <= 0 or not index then return 0 end
  local k = #redis.call('ZRANGEBYSCORE', index, '-inf', cutoff, 'LIMIT', 0, n)  -- due by then: arrived by then too
  if k >= n then return n end
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', index, '(' .. cutoff, '+inf')) do  -- due later: by arrival
    if tonumber(string.sub(member, 1, 16)) <= cutoff then  -- a member's first 16 digits: the entry's ms
      k = k + 1
      if k >= n then break end
    end
  end
  return k
end
local function orphans(key)  -- entries idle past min_idle (their worker is dead), taken over; parked ones stay
  local mine = {}
  local index = index_for(key)
  local parked = index and redis.call('ZCARD', index) or 0
  for _, row in ipairs(redis.call('XPENDING', key, group, 'IDLE', min_idle, '-', '+', want + parked)) do
    if #mine >= want then break end
    local id = row[1]
    if not (row[2] == holder and index and redis.call('ZSCORE', index, pad(id))) then
      local n = row[4] + 1
      local claimed = redis.call('XCLAIM', key, group, consumer, 0, id, 'RETRYCOUNT', n, 'JUSTID')
      local found = redis.call('XRANGE', key, id, id)[1]
      mine[#mine + 1] = {id, found and found[2] or false, #claimed > 0 and n or 1}  -- Redis 7: gone, dropped
    end
  end
  want = want - #mine
  return mine
end
"""


def due_read_inputs(window: int) -> dict:
    """The read script's deadline order inputs (`input.due`): the window (0: park nothing, take parked ones first),
    the holder consumer and the entries' deadline field."""
    return {"window": window, "holder": Keys.PARKED, "field": DUE_FIELD}
