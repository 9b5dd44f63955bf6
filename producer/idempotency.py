"""Same idempotency key -> the same job: claim the key and enqueue in one atomic script.

The claim stores "job_id digest owner entry", where owner is a hash of the claiming client's id (any producer
may read a claim whose key it can guess, and the client id itself would name that client's reply stream) and
entry is the job's stream entry id (so a later client can tell whether that job is still alive). One script
both XADDs and claims, so a crash can never leave a claimed key with no job behind it; an out-of-memory
refusal stops it at the XADD, before anything is written.

A claim must never point at a result that no longer exists: the workers' result TTL is often shorter than
the claim's. So before honouring a held claim the script checks that its job is still alive (its result is
there, or it is queued or running); if not, it enqueues this request as a new job and takes the key over.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .errors import IdempotencyConflict
from .job_status import ENTRY_STATE_LUA

IDEMPOTENCY_TTL_S = 24 * 3600

# KEYS[1] claim, KEYS[2] job stream (KEYS[3..6] with fair share: the band's Keys.fair_keys, ARGV[8] the tenant); ARGV: claim ("job_id digest owner"), ttl, field, payload, group, result key
# prefix, digest, tenant, then the deadline's field and value where the job has one (protocol.due_fields). Returns {0, held claim} when an earlier job holds the key and is alive (or the bodies differ:
# a conflict), {1, entry id} when this call enqueued the job, {2, entry id} when it did so because the earlier
# job's result is gone (expired) or the job was lost. The result key is built here from the held job id, so
# it cannot be declared: fine on one Redis, and a cluster puts all of a namespace in one slot anyway.
# A tenant joins its band's backlog (fair share, worker/fair.py) with every job it enqueues, in the job's script: a
# worker that finds the stream empty drops the tenant, so a job added apart from its ZADD could be stranded. A tenant
# new to the backlog enters at -inf (the worker places it at the band's virtual time when it next serves it), joins
# the streams index (the pruning pass deletes its stream once empty) and rings the band's bell (idle workers wait on
# it); the count of queued jobs goes up by one. KEYS: Keys.fair_keys(band).
FAIR_JOIN_LUA = """
local function fair_join(backlog, queued, known, bell, tenant)
  if redis.call('ZADD', backlog, 'NX', '-inf', tenant) == 1 then
    redis.call('ZADD', known, 'NX', 0, tenant)
    redis.call('XADD', bell, 'MAXLEN', 8, '*', 't', tenant)
  end
  redis.call('INCR', queued)
end
"""
CLAIM_AND_ENQUEUE = ENTRY_STATE_LUA + FAIR_JOIN_LUA + """
local held = redis.call('GET', KEYS[1])
if held then
  local parts = {}
  for word in string.gmatch(held, '%S+') do parts[#parts + 1] = word end
  local alive = true
  if parts[2] == ARGV[7] and parts[4] and redis.call('EXISTS', ARGV[6] .. parts[1]) == 0 then
    local state = entry_state(KEYS[2], ARGV[5], group_view(KEYS[2], ARGV[5]), parts[4])
    alive = state == 'running' or state == 'queued'
  end
  if alive then return {0, held} end
end
local id = redis.call('XADD', KEYS[2], '*', ARGV[3], ARGV[4], unpack(ARGV, 9))
if KEYS[3] then fair_join(KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[8]) end  -- fair share
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. id, 'EX', ARGV[2])
if held then return {2, id} end
return {1, id}
"""


def owner_tag(client_id: str) -> str:
    """Tells 'my job' from 'another client's job' without revealing the client id (and so its reply stream)."""
    return hashlib.sha256(client_id.encode()).hexdigest()[:32]


@dataclass(slots=True, frozen=True)
class Claim:
    job_id: str
    digest: str
    owner: str  # owner_tag of the client that enqueued the job
    entry: str = ""  # the job's stream entry id ("" in claims written before it was recorded)

    def encode(self) -> str:
        """Without the entry: the script appends it once XADD has chosen it."""
        return f"{self.job_id} {self.digest} {self.owner}"

    @classmethod
    def decode(cls, raw: bytes | str) -> "Claim":
        text = raw.decode() if isinstance(raw, bytes) else raw
        job_id, digest, owner, entry = (text.split(" ") + ["", "", ""])[:4]
        return cls(job_id, digest, owner, entry)


def resolve(key: str, mine: Claim, reply: list) -> Claim:
    """The claim that owns the key after the script ran: ours (with its new entry id) if the key was free,
    else the earlier one."""
    fresh, value = reply
    if int(fresh):  # 1: the key was free; 2: it named a job whose result is gone, so this is a new job
        return Claim(mine.job_id, mine.digest, mine.owner, value.decode() if isinstance(value, bytes) else value)
    earlier = Claim.decode(value)
    if earlier.digest != mine.digest:
        raise IdempotencyConflict(key, earlier.job_id)
    return earlier
