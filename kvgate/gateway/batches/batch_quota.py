"""A tenant's managed batches under one ceiling of their own: the jobs in flight and the tokens per sliding minute of
all its batches together, on every replica. --batch-window bounds one batch; without this a tenant's N batches would
hold N windows, past whatever its quota says.

The ceilings are the tenant's `batch_max_jobs` and `batch_tokens_per_minute` (producer/quotas.py, `Quota.batch`: its
`max_jobs` and `tokens_per_minute` where unset). They are counted in Redis as the interactive quotas are, in the same
sliding minute, but apart from them: a tenant's batches never take its interactive requests' room, and the other way
round. Five keys of shard 0 (one slot on a Redis Cluster), laid out as the interactive ones: `{ns}:quota:batch:leases`
(zset `tenant|jobs|batch_id|custom_id` -> lease end, server ms: one member per line, its job count in the member so
that a lapsed lease gives back the right number), `:jobs`, `:tokens`, `:tokens:prev` and `:window`.

A line is charged (its jobs, and its tokens estimated as an interactive job's are) before its jobs are submitted, and
given back once: when it is answered (its tokens corrected to what its jobs used), when it goes back to the queue
unsubmitted (its estimate given back whole), or when its batch's run here ends any other way, cancelled, expired, its
input deleted or this replica stopping (its estimate kept: its jobs may have run). The replica driving the batch
renews its lines' leases; one that dies leaves them to lapse after --batch-lease, when any admission prunes them. A
line still charged is adopted, not counted again, by a run that submits it anew (a resumed batch, a lost job).

Lines are admitted in order while they fit; one larger than the whole ceiling goes alone, once none of the tenant's
batch jobs are in flight (or none of its batch tokens in the window), as one over --batch-window does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvgate.openai.batch import BatchRequest
from kvgate.producer.keys import Keys
from kvgate.producer.quotas import _CLOCK, PRUNE_BATCH, Quota, Quotas, estimate_tokens
from kvgate.producer.request import build_job, validate_request

# the interactive quotas' prelude turns the minute over alike; a line's member names its tenant and job count
_LINES = _CLOCK + """
local function drop_line(member)
  local who, n = string.match(member, '^([^|]+)|(%d+)|')
  if not who then return end
  redis.call('HINCRBY', KEYS[5], 'jobs', -tonumber(n))
  if tonumber(redis.call('ZINCRBY', KEYS[2], -tonumber(n), who)) <= 0 then redis.call('ZREM', KEYS[2], who) end
end
"""

# ARGV: tenant, max_jobs (-1: none), tokens_per_minute (-1: none), lease_ms, then (member, tokens) per line in order.
# Returns {minute, {verdict per line}}: 1 charged now, 2 already charged (adopted, lease renewed), 0 refused. After
# the first line refused no later one is charged, so lines keep their order; charged ones are admitted wherever.
TAKE = _LINES + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, """ + str(PRUNE_BATCH) + """)
for _, member in ipairs(expired) do
  redis.call('ZREM', KEYS[1], member)
  drop_line(member)
end
local tenant, max_jobs, tpm, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local held = tonumber(redis.call('ZSCORE', KEYS[2], tenant) or 0)
local into = now % 60000
local used = tonumber(redis.call('ZSCORE', KEYS[3], tenant) or 0)
  + math.floor(tonumber(redis.call('ZSCORE', KEYS[4], tenant) or 0) * (60000 - into) / 60000)
local verdicts, full = {}, false
for i = 5, #ARGV, 2 do
  local member, tokens = ARGV[i], tonumber(ARGV[i + 1])
  local n = tonumber(string.match(member, '^[^|]+|(%d+)|'))
  if redis.call('ZSCORE', KEYS[1], member) then
    redis.call('ZADD', KEYS[1], now + lease, member)
    verdicts[#verdicts + 1] = 2
  elseif not full and (max_jobs < 0 or held == 0 or held + n <= max_jobs)
      and (tpm < 0 or used == 0 or used + tokens <= tpm) then
    redis.call('ZADD', KEYS[1], now + lease, member)
    redis.call('ZINCRBY', KEYS[2], n, tenant)
    redis.call('HINCRBY', KEYS[5], 'jobs', n)
    held = held + n
    if tokens > 0 then
      redis.call('ZINCRBY', KEYS[3], tokens, tenant)
      redis.call('HINCRBY', KEYS[5], 'tokens', tokens)
      used = used + tokens
    end
    verdicts[#verdicts + 1] = 1
  else
    full = true
    verdicts[#verdicts + 1] = 0
  end
end
return {minute, verdicts}
"""

# ARGV: (member, minute charged, token correction) per line. A line is given back once (its lease gone: no-op); a
# correction lands in the minute it was charged in while that minute is still in the window.
RELEASE = _LINES + """
for i = 1, #ARGV, 3 do
  local member, charged, fix = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  if redis.call('ZREM', KEYS[1], member) == 1 then drop_line(member) end
  local tenant = string.match(member, '^([^|]+)|')
  if tenant then correct_tokens(tenant, charged, fix) end
end
return 1
"""

# KEYS: leases. ARGV: lease_ms, members. Only members still there: one pruned has already been given back.
RENEW = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i]) end
return 1
"""

CALL_LINES = 500  # lines per script call: bounded work in Redis whatever the batch


def batch_quota_keys(keys: Keys) -> list[str]:
    """leases, jobs, tokens, tokens:prev, window: the interactive quotas' layout under `quota:batch`, in shard 0."""
    return [f"{keys.prefix}:quota:batch:{part}" for part in ("leases", "jobs", "tokens", "tokens:prev", "window")]


def line_tokens(req: BatchRequest) -> int:
    """What a line may cost before it runs, as the interactive quotas estimate each of its jobs (`estimate_tokens`)."""
    return sum(estimate_tokens(build_job(validate_request(args), "batch-estimate")) for args in req.jobs)


@dataclass(slots=True)
class LineCharge:
    member: str
    tokens: int  # the estimate charged by this run; 0 for a line adopted from an earlier run
    minute: int  # the server minute it was charged in; -1 for an adopted line (nothing to correct: not ours)
    sent: bool = False  # its jobs were (maybe partly) submitted: only a line never sent gives its estimate back


@dataclass(slots=True)
class BatchCeiling:
    """One batch's charges against its tenant's batch ceiling, in the replica driving the batch."""

    quota: BatchQuota
    tenant: str
    batch_id: str
    ceiling: Quota  # the tenant's batch ceilings (Quota.batch); none set: counted, never refused
    estimates: dict[str, int] = field(default_factory=dict)  # custom_id -> tokens
    held: dict[str, LineCharge] = field(default_factory=dict)  # custom_id -> its charge, until given back
    renewed_at: float = field(default_factory=time.monotonic)

    def estimate(self, lines: list[BatchRequest]) -> None:
        """The lines' token estimates (in a thread: each job is validated as the SDK would)."""
        self.estimates.update((req.custom_id, line_tokens(req)) for req in lines)

    def member(self, req: BatchRequest) -> str:
        return f"{self.tenant}|{len(req.jobs)}|{self.batch_id}|{req.custom_id}"

    async def admit(self, lines: list[BatchRequest]) -> list[BatchRequest]:
        """The lines charged (or already charged), in order: the first that does not fit, and every new one after it,
        stay out."""
        q, admitted = self.quota, []
        ceiling = [-1 if v is None else v for v in (self.ceiling.max_jobs, self.ceiling.tokens_per_minute)]
        for start in range(0, len(lines), CALL_LINES):
            part = lines[start:start + CALL_LINES]
            args = [self.tenant, *ceiling, int(q.lease_s * 1000)]
            for req in part:
                args += [self.member(req), self.estimates.get(req.custom_id, 0)]
            minute, verdicts = await q.take(keys=q.keys, args=args)
            for req, verdict in zip(part, verdicts):
                if verdict == 1:
                    self.held[req.custom_id] = LineCharge(self.member(req), self.estimates.get(req.custom_id, 0),
                                                          int(minute))
                elif verdict == 2:  # this run's own (a lost job resubmitted) or an earlier run's: sent, maybe
                    self.held.setdefault(req.custom_id, LineCharge(self.member(req), 0, -1, sent=True))
                if verdict:
                    admitted.append(req)
        return admitted

    def sent(self, custom_ids: list[str]) -> None:
        for custom_id in custom_ids:
            self.held[custom_id].sent = True

    async def answered(self, used: dict[str, int]) -> None:
        """Lines answered, with the tokens their jobs used: given back, their estimates corrected."""
        await self._give_back([(c, used[c] - charge.tokens) for c in used
                               if (charge := self.held.get(c)) is not None])

    async def unsent(self, custom_ids: list[str]) -> None:
        """Lines going back to the queue: those never sent give their estimates back whole; the others (jobs of theirs
        are in the fleet) stay charged."""
        await self._give_back([(c, -charge.tokens) for c in custom_ids
                               if (charge := self.held.get(c)) is not None and not charge.sent])

    async def end(self) -> None:
        """The run here is over (cancelled, expired, input deleted, this replica stopping): every line still charged
        is given back, its estimate kept."""
        await self._give_back([(c, 0) for c in self.held])

    async def renew(self) -> None:
        """Every third of a lease: the lines charged here stay charged while this replica drives the batch."""
        q = self.quota
        if time.monotonic() - self.renewed_at < q.lease_s / 3 or not self.held:
            return
        self.renewed_at = time.monotonic()
        members = [charge.member for charge in self.held.values()]
        for start in range(0, len(members), CALL_LINES):
            await q.renew(keys=q.keys[:1], args=[int(q.lease_s * 1000), *members[start:start + CALL_LINES]])

    async def _give_back(self, fixes: list[tuple[str, int]]) -> None:
        q = self.quota
        for start in range(0, len(fixes), CALL_LINES):
            args = []
            for custom_id, fix in fixes[start:start + CALL_LINES]:
                charge = self.held[custom_id]
                args += [charge.member, charge.minute, fix]
            await q.release(keys=q.keys, args=args)
            for custom_id, _ in fixes[start:start + CALL_LINES]:
                del self.held[custom_id]


class BatchQuota:
    """The batch ceilings of every tenant, as one gateway's batch runner applies them."""

    def __init__(self, r, keys: Keys, quotas: Quotas | None, lease_s: float):
        """`quotas`: the gateway's table (None: no tenant has a ceiling, and nothing is counted, as for interactive
        requests); `lease_s`: --batch-lease, how long a line stays charged after its replica stops renewing it."""
        self.quotas, self.lease_s, self.keys = quotas, lease_s, batch_quota_keys(keys)
        self.take, self.release, self.renew = (r.register_script(s) for s in (TAKE, RELEASE, RENEW))

    def of(self, tenant: str, batch_id: str) -> BatchCeiling | None:
        if self.quotas is None:
            return None
        return BatchCeiling(self, tenant, batch_id, self.quotas.of(tenant).batch)
