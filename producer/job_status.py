"""Where a job is: queued, running on which worker, finished, or lost (in no stream, pending nowhere, no result).

A job acknowledged without a result cannot happen (invariant 2), so a job that is neither queued, pending nor
finished will never finish: Redis lost it (a restart without persistence, a failover to a replica that had
not received it) or its result expired. One script reads the entry's state in the job stream, then the result
keys are read: a job acknowledged meanwhile has its result by then (the ack and the result are one atomic step),
so a job finishing meanwhile is never taken for lost. It needs the job's stream entry id, which the submitting
client knows; for a bare job id the SDK can still tell finished and running (by the workers' pending entries, in
the shared streams and, under fair share, in the tenants' streams a band's pending index names).
Step functions (steps.py): the Client runs them with blocking calls, the AsyncClient on its event loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec
import redis

from .lanes import parse_lanes
from .keys import ID_AFTER_LUA, Keys, as_text
from .protocol import FIELD
from .queue_stats import known_models
from .steps import Steps, call

State = Literal["queued", "running", "finished", "lost", "unknown"]

# Lua functions shared with the idempotency claim script: the group's view of a job stream, then one entry's
# state in it: running <consumer> | queued | acked (delivered and acknowledged: finished) | gone <why>. Callers
# read result keys after these: an acknowledged job always has its result by then, unless it expired. XRANGE
# tells whether an undelivered entry is still there; a least-privilege producer (deploy/redis/acl.conf) may not
# read job payloads, so for it the group's lag (Redis 7) or the stream's length answers instead.
ENTRY_STATE_LUA = ID_AFTER_LUA + f"local PARKED = '{Keys.PARKED}'\n" + """
local function group_view(stream, group)
  local view = {length = redis.call('XLEN', stream)}
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) == 'table' and not groups.err then
    for _, g in ipairs(groups) do
      local f = {}
      for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
      if f['name'] == group then view.delivered, view.lag = f['last-delivered-id'], f['lag'] end
    end
  end
  return view
end
local function entry_state(stream, group, view, id)
  if view.delivered then
    local row = redis.pcall('XPENDING', stream, group, id, id, 1)
    if type(row) == 'table' and row[1] then  -- parked for deadline order (Keys.PARKED): read, still waiting
      if row[1][2] == PARKED then return 'queued', '' end
      return 'running', row[1][2]
    end
    if not id_after(id, view.delivered) then return 'acked', '' end
  end
  local found = redis.pcall('XRANGE', stream, id, id, 'COUNT', 1)
  local readable = type(found) == 'table' and not found.err
  if view.length == 0 or (readable and #found == 0) or (not readable and view.lag == 0) then
    return 'gone', 'it is in no job stream: Redis lost it (a restart without persistence or a failover)'
  end
  return 'queued', ''
end
"""

# KEYS[1] job stream; ARGV[1] group, ARGV[2..n] entry ids. Returns one {state, detail} per entry.
JOB_STATES_LUA = ENTRY_STATE_LUA + """
local view = group_view(KEYS[1], ARGV[1])
local out = {}
for i = 2, #ARGV do
  local state, detail = entry_state(KEYS[1], ARGV[1], view, ARGV[i])
  out[#out + 1] = {state, detail}
end
return out
"""
ACKED_WITHOUT_RESULT = "it was acknowledged but its result is gone (expired or deleted)"


@dataclass(slots=True, frozen=True)
class JobStatus:
    job_id: str
    state: State  # queued | running | finished | lost | unknown
    worker: str | None = None  # the consumer holding it, while running
    detail: str = ""  # why it is lost, or why its state is unknown

    def __str__(self) -> str:
        where = f" on {self.worker}" if self.worker else ""
        return f"job {self.job_id}: {self.state}{where}{': ' + self.detail if self.detail else ''}"


def read_states(r, script, keys: Keys, stream: str, jobs: list[tuple[str, str]]) -> Steps:
    """States of (job_id, entry id) pairs that all sit in `stream`: the script, then the result keys."""
    if not jobs:
        return []
    rows = yield lambda: script(keys=[stream], args=[Keys.GROUP, *(e for _, e in jobs)], client=r)
    shard = keys.of_stream(stream)
    results = yield call(r.execute_command, "MGET", *[shard.result(j) for j, _ in jobs])  # one slot: the stream's
    return [state_of(job_id, as_text(state), as_text(detail), result is not None)
            for (job_id, _), (state, detail), result in zip(jobs, rows, results)]


def state_of(job_id: str, state: str, detail: str, has_result: bool) -> JobStatus:
    if has_result:
        return JobStatus(job_id, "finished")
    if state == "running":
        return JobStatus(job_id, "running", detail)
    if state == "queued":
        return JobStatus(job_id, "queued")
    return JobStatus(job_id, "lost", detail=ACKED_WITHOUT_RESULT if state == "acked" else detail)


class _JobId(msgspec.Struct):
    job_id: str


_job_id = msgspec.msgpack.Decoder(_JobId)
PENDING_SCAN = 1000  # pending entries are bounded by what the fleet can hold at once


PENDING_TENANTS = 1000  # tenants' streams looked at per band: the pending index holds those read lately


def find_running(r, keys: Keys, job_id: str) -> Steps:
    """A bare job id: look for it among the entries the workers hold (no entry id needed), in the shared streams
    and lanes, and under fair share in the tenants' streams a band's pending index names (the streams workers
    have read since they were last found with nothing pending: bounded by what the fleet holds, not by the
    tenants there are)."""
    lanes = parse_lanes((yield call(r.get, keys.lanes())))
    models = yield from known_models(r, keys)
    streams = [st for model in models for st in keys.all_jobs(model, lanes)]
    bands = [st for model in models for st in keys.all_jobs(model)]
    pipe = r.pipeline(transaction=False)
    for band in bands:
        pipe.zrange(Keys.fair_pending(band), 0, PENDING_TENANTS - 1)
    for band, tenants in zip(bands, (yield lambda: pipe.execute(raise_on_error=False))):
        if isinstance(tenants, redis.exceptions.NoPermissionError):
            raise tenants
        if not isinstance(tenants, Exception):
            streams += [Keys.tenant_jobs(band, as_text(t)) for t in tenants]
    pipe = r.pipeline(transaction=False)
    for stream in streams:
        pipe.xpending_range(stream, Keys.GROUP, min="-", max="+", count=PENDING_SCAN)
    held = []
    for stream, rows in zip(streams, (yield lambda: pipe.execute(raise_on_error=False))):
        if isinstance(rows, redis.exceptions.NoPermissionError):
            raise rows
        if not isinstance(rows, Exception):  # else: no such stream or group yet
            held += [(stream, row) for row in rows]
    pipe = r.pipeline(transaction=False)
    for stream, row in held:
        pipe.xrange(stream, min=row["message_id"], max=row["message_id"], count=1)
    for (stream, row), found in zip(held, (yield lambda: pipe.execute(raise_on_error=False))):
        if isinstance(found, redis.exceptions.NoPermissionError):
            raise found
        payload = found[0][1].get(FIELD.encode()) if found and not isinstance(found, Exception) else None
        try:
            if payload is not None and _job_id.decode(payload).job_id == job_id:
                if as_text(row["consumer"]) == Keys.PARKED:  # parked for deadline order: waiting still
                    return JobStatus(job_id, "queued")
                return JobStatus(job_id, "running", as_text(row["consumer"]))
        except msgspec.DecodeError:
            continue
    return None


def job_states_script(r):
    return r.register_script(JOB_STATES_LUA)


def job_status(r, script, keys: Keys, job_id: str, entry: tuple[str, str] | None) -> Steps:
    """One job's status; exact with its (stream, entry id), best effort for a bare job id."""
    if entry is not None:
        return (yield from read_states(r, script, keys, entry[0], [(job_id, entry[1])]))[0]
    if (yield call(r.exists, keys.result(job_id))):
        return JobStatus(job_id, "finished")
    try:
        running = yield from find_running(r, keys, job_id)
    except redis.exceptions.NoPermissionError:  # a least-privilege producer may not read job payloads
        running = None
    if running is not None and (yield call(r.exists, keys.result(job_id))):  # it finished while we looked
        return JobStatus(job_id, "finished")
    return running or JobStatus(job_id, "unknown", detail=UNKNOWN)


UNKNOWN = ("not finished and not held by a worker; only the client that submitted it knows its stream entry, "
           "which tells queued from lost (JobHandle.status())")
