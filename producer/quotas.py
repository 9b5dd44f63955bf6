"""Per-tenant quotas, counted in Redis so every producer and gateway replica enforces the same numbers.

Two ceilings per tenant, each optional:
- `max_jobs`: jobs in flight, queued or running (a producer cannot tell the two apart without asking the worker's
  pending list for every job, so both are counted: a job holds its slot from admission to its final event).
- `tokens_per_minute`: prompt plus generated tokens over a sliding minute. A job is charged an estimate at admission
  (its prompt's characters / 4, or its token ids, plus max_tokens) and the estimate is corrected to the job's usage
  when its final event arrives (a job cancelled or expired before it ran gives the estimate back).
A tenant's managed batches, all together, have the same two ceilings of their own (`batch_max_jobs`,
`batch_tokens_per_minute`; unset: the two above), counted apart in kvgate/gateway/batches/batch_quota.py.

Admission, release and pruning are Lua scripts over five keys of shard 0 (one slot on a Redis Cluster):
`{ns}:quota:leases` (zset `tenant|job_id` -> lease end, server ms), `{ns}:quota:jobs` (zset tenant -> jobs in flight;
a tenant leaves it at zero), `{ns}:quota:tokens` and `{ns}:quota:tokens:prev` (zset tenant -> tokens charged in this
and the previous server minute), `{ns}:quota:window` (hash: the minute, and the totals stats need for `other`).

No leaked slots: the producer that admitted a job releases its slot when the job's final event (or the news that it
was lost) reaches its reply reader; a job whose producer died keeps its slot only until its lease ends (the gateway:
its request timeout plus a minute), after which any admission in the namespace prunes it (up to PRUNE_BATCH a call).
"""
from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package (pyproject's dependencies)
    import tomli as tomllib

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import FieldError, QuotaExceeded
from .keys import Keys, as_text
from .limits import DEFAULT_TENANT, TOP_TENANTS, top_and_rest
from .protocol import Final, Job, ProtocolError, check_tenant_name
from .steps import Steps, call

PRUNE_BATCH = 100  # expired leases one admission removes: bounded work, amortised over admissions
WINDOW_MS = 60_000

# KEYS[1..5]: leases, jobs, tokens, tokens:prev, window. Turns the token window over to the server's current minute.
_CLOCK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local minute = math.floor(now / 60000)
local was = tonumber(redis.call('HGET', KEYS[5], 'minute') or -1)
if was < minute then
  if was == minute - 1 and redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('RENAME', KEYS[3], KEYS[4])
  else
    redis.call('DEL', KEYS[3], KEYS[4])
  end
  local prev = 0
  if was == minute - 1 then prev = tonumber(redis.call('HGET', KEYS[5], 'tokens') or 0) end
  redis.call('HSET', KEYS[5], 'minute', minute, 'tokens', 0, 'tokens_prev', prev)
end
local function drop_job(tenant)
  redis.call('HINCRBY', KEYS[5], 'jobs', -1)
  if tonumber(redis.call('ZINCRBY', KEYS[2], -1, tenant)) <= 0 then redis.call('ZREM', KEYS[2], tenant) end
end
-- a token estimate corrected to what was used, in the minute it was charged in while that minute is in the window
local function correct_tokens(tenant, charged, fix)
  if fix ~= 0 and (charged == minute or charged == minute - 1) then
    local key, total = KEYS[3], 'tokens'
    if charged ~= minute then key, total = KEYS[4], 'tokens_prev' end
    local left = tonumber(redis.call('ZINCRBY', key, fix, tenant))
    if left < 0 then fix = fix - left; redis.call('ZADD', key, 0, tenant) end
    redis.call('HINCRBY', KEYS[5], total, fix)
  end
end
"""

# ARGV: tenant, max_jobs (-1: none), tokens_per_minute (-1: none), tokens, lease_ms, job ids...
# Returns {verdict, jobs in flight, tokens in the window, ms until the window frees tokens, minute}.
TAKE = _CLOCK + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, """ + str(PRUNE_BATCH) + """)
for _, member in ipairs(expired) do
  redis.call('ZREM', KEYS[1], member)
  local who = string.match(member, '^([^|]+)|')
  if who then drop_job(who) end
end
local tenant, max_jobs, tpm = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, lease, n = tonumber(ARGV[4]), tonumber(ARGV[5]), #ARGV - 5
local held = tonumber(redis.call('ZSCORE', KEYS[2], tenant) or 0)
local into = now % 60000
local used = tonumber(redis.call('ZSCORE', KEYS[3], tenant) or 0)
  + math.floor(tonumber(redis.call('ZSCORE', KEYS[4], tenant) or 0) * (60000 - into) / 60000)
if max_jobs >= 0 and held + n > max_jobs then return {'jobs', held, used, 0, minute} end
if tpm >= 0 and used + tokens > tpm then return {'tokens', held, used, 60000 - into, minute} end
for i = 6, #ARGV do redis.call('ZADD', KEYS[1], now + lease, tenant .. '|' .. ARGV[i]) end
redis.call('ZINCRBY', KEYS[2], n, tenant)
redis.call('HINCRBY', KEYS[5], 'jobs', n)
if tokens > 0 then
  redis.call('ZINCRBY', KEYS[3], tokens, tenant)
  redis.call('HINCRBY', KEYS[5], 'tokens', tokens)
end
return {'ok', held + n, used + tokens, 0, minute}
"""

# ARGV: (tenant, job_id, minute charged, token correction) per job. A slot is given back once (its lease gone: no-op);
# a correction lands in the minute the estimate was charged in while that minute is still in the window.
RELEASE = _CLOCK + """
for i = 1, #ARGV, 4 do
  local tenant, charged, fix = ARGV[i], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  if redis.call('ZREM', KEYS[1], tenant .. '|' .. ARGV[i + 1]) == 1 then drop_job(tenant) end
  correct_tokens(tenant, charged, fix)
end
return 1
"""


def quota_scripts(r) -> tuple:
    """The admission and release scripts, registered on a client (blocking or asyncio, one Redis or a cluster)."""
    return r.register_script(TAKE), r.register_script(RELEASE)


def quota_keys(keys: Keys) -> list[str]:
    return [keys.quota_leases(), keys.quota_jobs(), keys.quota_tokens(), keys.quota_tokens_prev(),
            keys.quota_window()]


class Quota(BaseModel):
    """One tenant's ceilings; None: no ceiling."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_jobs: int | None = Field(None, ge=1, description="jobs in flight (queued or running)")
    tokens_per_minute: int | None = Field(None, ge=1, description="prompt plus generated tokens per sliding minute")
    batch_max_jobs: int | None = Field(None, ge=1, description="managed batches' jobs in flight, all of the tenant's "
                                                               "batches together (unset: max_jobs)")
    batch_tokens_per_minute: int | None = Field(None, ge=1, description="managed batches' tokens per sliding minute, "
                                                                        "all of them together (unset: "
                                                                        "tokens_per_minute)")

    @property
    def unlimited(self) -> bool:
        return all(v is None for v in (self.max_jobs, self.tokens_per_minute, self.batch_max_jobs,
                                         self.batch_tokens_per_minute))

    @property
    def batch(self) -> "Quota":
        """The ceilings of the tenant's managed batches, all of them together, counted apart from its interactive jobs
        (kvgate/gateway/batches/batch_quota.py): their own where set, else the interactive ones, so that no number of
        batches multiplies the tenant's share."""
        return Quota(max_jobs=self.max_jobs if self.batch_max_jobs is None else self.batch_max_jobs,
                     tokens_per_minute=self.tokens_per_minute if self.batch_tokens_per_minute is None
                     else self.batch_tokens_per_minute)


def _given(err: Mapping) -> str:
    """The value a quotas file gave where it is one value (a table would be the whole table), shortened."""
    value = err.get("input")
    return "" if isinstance(value, (dict, list)) else f" (got {repr(value)[:40]})"


class Quotas(BaseModel):
    """Every tenant's quota: `default` for tenants not listed. A TOML file reads as

        [default]
        max_jobs = 100
        tokens_per_minute = 200000
        [tenants.team-a]
        max_jobs = 10
        batch_max_jobs = 4   # its managed batches, all together (unset: its max_jobs)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: Quota = Quota()
    tenants: dict[str, Quota] = {}

    @field_validator("tenants")
    @classmethod
    def _names(cls, tenants: dict[str, Quota]) -> dict[str, Quota]:
        for name in tenants:
            try:
                check_tenant_name(name)
            except ProtocolError as e:
                raise ValueError(str(e)) from None
        return tenants

    @classmethod
    def read(cls, path: str | Path, default: Quota | None = None) -> "Quotas":
        """The file's quotas; `default` fills the ceilings its [default] table leaves out. ValueError names the
        file and what is wrong in it."""
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"quotas file {path}: {e}; see docs/tenants/quotas.md for its format") from None
        try:
            quotas = cls.model_validate(data)
        except ValidationError as e:
            wrong = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'file'}: {err['msg']}{_given(err)}"
                              for err in e.errors())
            raise ValueError(f"quotas file {path}: {wrong}; see docs/tenants/quotas.md for its format") from None
        if default is not None:
            given = data.get("default", {})
            quotas = quotas.model_copy(update={"default": default.model_copy(update=given)})
        return quotas

    def of(self, tenant: str) -> Quota:
        return self.tenants.get(tenant, self.default)

    @property
    def unlimited(self) -> bool:
        return self.default.unlimited and all(q.unlimited for q in self.tenants.values())


def estimate_tokens(job: Job) -> int:
    """What a job may cost before it runs: its prompt (token ids, else characters / 4) plus max_tokens (none for an
    embedding, which generates nothing)."""
    if job.prompt_token_ids is not None:
        prompt = len(job.prompt_token_ids)
    else:
        chars = len(job.prompt or "") + sum(len(m.content) for m in job.messages or [])
        prompt = math.ceil(chars / 4)
    return prompt + (0 if job.task == "embed" else job.sampling.max_tokens)


@dataclass(frozen=True, slots=True)
class Charge:
    """One admitted job's slot and tokens, until its final event."""

    tenant: str
    job_id: str
    tokens: int
    minute: int


def over_whole_quota(quotas: Quotas, jobs: list[Job], wheres: list[str]) -> FieldError | None:
    """`never_fits` for each tenant's jobs of one admission: the first tenant's reason, or None."""
    by_tenant: dict[str, list[int]] = {}
    for i, job in enumerate(jobs):
        by_tenant.setdefault(tenant_of(job), []).append(i)
    for tenant, at in by_tenant.items():
        error = never_fits(tenant, quotas.of(tenant), [jobs[i] for i in at], [wheres[i] for i in at])
        if error is not None:
            return error
    return None


def never_fits(tenant: str, quota: Quota, jobs: list[Job], wheres: list[str]) -> FieldError | None:
    """What makes one admission of these jobs of a tenant larger than its whole ceiling, so that no wait can admit it
    (a 400, where a ceiling only full for now is a QuotaExceeded, a 429); None when it may fit. `wheres`: each job's
    argument prefix (`requests[i].`)."""
    if quota.max_jobs is not None and len(jobs) > quota.max_jobs:
        return FieldError("requests", len(jobs), f"{len(jobs)} jobs of tenant {tenant!r} in one admission are over its "
                                                 f"whole max_jobs={quota.max_jobs}, so no wait can admit them: send "
                                                 f"at most {quota.max_jobs} at a time, or raise the tenant's quota")
    tpm = quota.tokens_per_minute
    if tpm is None:
        return None
    estimates = [estimate_tokens(j) for j in jobs]
    for job, where, estimate in zip(jobs, wheres, estimates):
        if estimate > tpm:
            return _over_minute(tenant, tpm, job, where, estimate)
    if sum(estimates) > tpm:
        return FieldError("requests", len(jobs), f"these jobs of tenant {tenant!r} may use {sum(estimates)} tokens "
                                                 f"together, over its whole tokens_per_minute={tpm}, so no wait can "
                                                 "admit them: send fewer at a time, with a lower max_tokens or "
                                                 "shorter prompts, or raise the tenant's quota")
    return None


def _over_minute(tenant: str, tpm: int, job: Job, where: str, estimate: int) -> FieldError:
    """One job over the tenant's whole tokens per minute: named by its max_tokens when lowering that fits it."""
    generated = 0 if job.task == "embed" else job.sampling.max_tokens
    prompt = estimate - generated
    ceiling = f"over tenant {tenant!r}'s whole tokens_per_minute={tpm}, so no wait can admit it"
    if prompt < tpm:
        return FieldError(f"{where}max_tokens", generated, f"with a prompt of about {prompt} tokens the job may use "
                                                           f"{estimate} tokens, {ceiling}: ask for at most "
                                                           f"{tpm - prompt}, or raise the tenant's quota")
    name = "prompt_token_ids" if job.prompt_token_ids is not None else "messages" if job.messages else "prompt"
    return FieldError(f"{where}{name}", f"about {prompt} tokens", f"the prompt alone is {ceiling}: shorten it, or "
                                                                  "raise the tenant's quota")


def take(r, script, keys: Keys, tenant: str, quota: Quota, jobs: list[Job], lease_s: float) -> Steps:
    """Admit `jobs` of one tenant, all or none: their charges, or QuotaExceeded."""
    estimates = [estimate_tokens(j) for j in jobs]
    args = [tenant, -1 if quota.max_jobs is None else quota.max_jobs,
            -1 if quota.tokens_per_minute is None else quota.tokens_per_minute, sum(estimates),
            int(lease_s * 1000), *(j.job_id for j in jobs)]
    verdict, held, used, reset_ms, minute = yield lambda: script(keys=quota_keys(keys), args=args, client=r)
    verdict = as_text(verdict)
    if verdict == "jobs":
        raise QuotaExceeded(tenant, "max_jobs", quota.max_jobs, int(held), len(jobs), retry_after_s=1.0)
    if verdict == "tokens":
        raise QuotaExceeded(tenant, "tokens_per_minute", quota.tokens_per_minute, int(used), sum(estimates),
                            retry_after_s=max(1.0, math.ceil(int(reset_ms) / 1000)))
    return [Charge(tenant, j.job_id, e, int(minute)) for j, e in zip(jobs, estimates)]


def release(r, script, keys: Keys, settled: list[tuple[Charge, int]]) -> Steps:
    """Give back the slots of settled jobs and correct their token charges (`(charge, tokens used)` each)."""
    for i in range(0, len(settled), 500):
        args = [a for c, used in settled[i:i + 500] for a in (c.tenant, c.job_id, c.minute, used - c.tokens)]
        yield lambda args=args: script(keys=quota_keys(keys), args=args, client=r)


@dataclass(slots=True)
class QuotaLedger:
    """A producer's charges until their jobs settle; the reply readers give them back. Thread-safe: the Client's
    reader threads settle while its callers charge."""

    held: dict[str, Charge] = field(default_factory=dict)
    settled: list[tuple[Charge, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, charges: Iterable[Charge]) -> None:
        with self._lock:
            self.held.update((c.job_id, c) for c in charges)

    def finished(self, job_id: str, final: Final | None) -> None:
        """A job's final event arrived (None: it was found lost, or never enqueued): settle its charge once."""
        with self._lock:
            charge = self.held.pop(job_id, None)
            if charge is not None:
                used = charge.tokens if final is None else final.usage.prompt_tokens + final.usage.completion_tokens
                self.settled.append((charge, used))

    def drop(self, job_ids: Iterable[str]) -> None:
        """Jobs that were never enqueued: their charges go back whole."""
        with self._lock:
            for job_id in job_ids:
                charge = self.held.pop(job_id, None)
                if charge is not None:
                    self.settled.append((charge, 0))

    def take_settled(self) -> list[tuple[Charge, int]]:
        with self._lock:
            out, self.settled = self.settled, []
            return out

    def put_back(self, settled: list[tuple[Charge, int]]) -> None:
        """A release that failed (Redis away): tried again on the next round."""
        with self._lock:
            self.settled = settled + self.settled


# -- visibility ------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class TenantUsage:
    tenant: str
    jobs: int = 0  # in flight: queued or running
    tokens_per_minute: int = 0  # charged over the sliding minute (estimates until their jobs finish)


@dataclass(slots=True)
class TenantsUsage:
    """The busiest tenants by name, and every other tenant summed: what stats show, bounded however many there are."""

    top: list[TenantUsage] = field(default_factory=list)
    other: TenantUsage = field(default_factory=lambda: TenantUsage("other"))

    def to_dict(self) -> dict:
        return {"top": [asdict(u) for u in self.top], "other": asdict(self.other) | {"tenant": None}}


def tenant_usage(r, keys: Keys, now_ms: int, top: int = TOP_TENANTS) -> Steps:
    """The busiest `top` tenants (by jobs in flight, then by tokens) and the rest summed, at `now_ms` on the server's
    clock: two round trips of bounded size whatever the number of tenants."""
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.quota_window())
    for key in (keys.quota_jobs(), keys.quota_tokens(), keys.quota_tokens_prev()):
        pipe.zrevrange(key, 0, top - 1)
    window, *tops = yield pipe.execute
    names = list(dict.fromkeys(as_text(t) for listed in tops for t in listed))
    scores: list[list] = [[], [], []]
    if names:
        pipe = r.pipeline(transaction=False)
        for key in (keys.quota_jobs(), keys.quota_tokens(), keys.quota_tokens_prev()):
            pipe.zmscore(key, names)
        scores = yield pipe.execute
    window = {as_text(k): int(float(v)) for k, v in window.items()}
    minute, into = divmod(now_ms, WINDOW_MS)
    fade = (WINDOW_MS - into) / WINDOW_MS

    def tokens(cur: float | None, prev: float | None) -> int:
        """The sliding minute as the next admission will see it (the window turns over then)."""
        cur, prev = cur or 0, prev or 0
        if window.get("minute") == minute:
            return int(cur + prev * fade)
        return int(cur * fade) if window.get("minute") == minute - 1 else 0

    rows = [TenantUsage(n, int(j or 0), tokens(c, p)) for n, j, c, p in zip(names, *scores)] if names else []
    rows, _ = top_and_rest((u for u in rows if u.jobs or u.tokens_per_minute),
                           lambda u: (-u.jobs, -u.tokens_per_minute, u.tenant), top)  # the rest: from the totals
    total_jobs, total_tokens = window.get("jobs", 0), tokens(window.get("tokens"), window.get("tokens_prev"))
    other = TenantUsage("other", max(0, total_jobs - sum(u.jobs for u in rows)),
                        max(0, total_tokens - sum(u.tokens_per_minute for u in rows)))
    return TenantsUsage(rows, other)


def quotas_of(value: "Quota | Quotas | Mapping | None") -> Quotas | None:
    """Client(quota=...): one Quota for the client's tenant(s), or a Quotas table; None or no ceiling: no quota."""
    if value is None:
        return None
    quotas = value if isinstance(value, Quotas) else Quotas(default=Quota.model_validate(value))
    return None if quotas.unlimited else quotas


def tenant_of(job: Job) -> str:
    return job.tenant or DEFAULT_TENANT
