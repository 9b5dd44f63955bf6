"""From validated submit arguments to pipelined Redis commands, shared by Client and AsyncClient."""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

from .cluster import run_script
from .connection import refusal_of
from .errors import Backpressure, FieldError
from .idempotency import CLAIM_AND_ENQUEUE, FAIR_JOIN_LUA, IDEMPOTENCY_TTL_S, Claim, owner_tag, resolve
from .lanes import lane_of, routing_key
from .redis_url import FAILOVER_BUDGET_S, FAILOVER_ERRORS
from .keys import DEFAULT_MODEL, Keys, as_text
from .limits import DEFAULT_TENANT
from .protocol import FIELD, Job, due_fields
from .quotas import estimate_tokens
from .request import build_job, encode_job, new_job_id, validate_request
from .spread import TenantSpread
from .steps import Sleep, Steps

CANCEL_TTL_S = 24 * 3600


@dataclass(slots=True)
class Prepared:
    """One job ready to enqueue: its payload, target stream and idempotency claim."""

    job: Job
    payload: bytes
    stream: str
    model: str  # the name its stream is keyed by (`default` for a job that names none)
    claim: Claim | None = None
    claim_key: str | None = None
    band: str | None = None  # fair share: the band whose backlog its tenant joins (worker/fair.py)
    result_prefix: str = ""
    claim_ttl_s: int = IDEMPOTENCY_TTL_S
    parse_as: Any = None  # a pydantic model class the answer's text is validated into (Result.parsed)


def prepare(kwargs: dict[str, Any], keys: Keys, client_id: str, where: str = "", lanes: int = 0,
            fair: bool = False, spread: TenantSpread | None = None) -> Prepared:
    """One request validated and made a job, and where it goes. With fair share on a cluster, `spread` deals the
    jobs without an idempotency key out over the shards (producer/spread.py)."""
    req = validate_request(kwargs, where)
    job = build_job(req, client_id, job_id=job_id_for(keys, req.idempotency_key), where=where)
    model = req.model or DEFAULT_MODEL
    if fair and spread is not None and req.idempotency_key is None:
        job.job_id = dealt_job_id(keys, spread, job, model)
    if fair:  # the tenant's stream in the band, which joins the band's backlog in the same script
        band = keys.jobs(model, job.priority, shard=keys.shard_of(job.job_id))
        prepared = Prepared(job, encode_job(job, where), Keys.tenant_jobs(band, job.tenant or DEFAULT_TENANT), model,
                            parse_as=req.parse_as, band=band)
    else:
        prepared = Prepared(job, encode_job(job, where), stream_for(job, model, keys, lanes, req.prefix_key), model,
                            parse_as=req.parse_as)
    if req.idempotency_key is not None:
        prepared.claim = Claim(job.job_id, req.digest(), owner_tag(client_id))
        prepared.claim_key = keys.idempotency(req.idempotency_key)
        prepared.result_prefix = keys.at(keys.shard_of(job.job_id)).result("")
    return prepared


def job_id_for(keys: Keys, idempotency_key: str | None) -> str | None:
    """On a cluster, a job with an idempotency key lives in the key's shard (a resubmission must meet the claim), so
    its id is drawn until it hashes there too: every key of the job is then in one slot. None: any new id."""
    if idempotency_key is None or len(keys.parts) == 1:
        return None
    return job_id_in(keys, keys.shard_of(idempotency_key))


def dealt_job_id(keys: Keys, spread: TenantSpread, job: Job, model: str) -> str:
    """A new id for `job` that hashes to the shard `spread` deals it to: its tenant's band's fewest estimated tokens
    from this producer."""
    shard = spread.shard_for(job.tenant or DEFAULT_TENANT, model, job.priority, estimate_tokens(job))
    return job_id_in(keys, shard)


def job_id_in(keys: Keys, shard: int) -> str:
    """A new job id that hashes to `shard` (one try in as many as there are shards, on average)."""
    while keys.shard_of(job_id := new_job_id()) != shard:
        pass
    return job_id


def stream_for(job: Job, model: str, keys: Keys, lanes: int, prefix_key: str | None = None) -> str:
    """The model's shared stream of the job's priority in the job's shard, or with lanes on, the model's lane its
    routing key hashes to."""
    shard = keys.shard_of(job.job_id)
    if not lanes:
        return keys.jobs(model, job.priority, shard=shard)
    key = routing_key(prompt=job.prompt, messages=job.messages, prompt_token_ids=job.prompt_token_ids,
                      prefix_key=prefix_key)
    return keys.jobs(model, job.priority, lane_of(key, lanes), shard)


def add_to_pipeline(pipe, script, prepared: Prepared):
    """Add one job's enqueue command to a pipeline. On an asyncio pipeline a script call is a coroutine that
    queues nothing until awaited: the caller must await what this returns when it is awaitable."""
    fair = Keys.fair_keys(prepared.band) if prepared.band else []
    tenant = prepared.job.tenant or DEFAULT_TENANT
    due = [x for pair in due_fields(prepared.job).items() for x in pair]  # with a deadline: its field and value
    if prepared.claim is None:
        if not fair:
            return pipe.xadd(prepared.stream, {FIELD: prepared.payload, **due_fields(prepared.job)})
        return run_script(fair_script(script), [prepared.stream, *fair], [FIELD, prepared.payload, tenant, *due], pipe)
    return run_script(script, [prepared.claim_key, prepared.stream, *fair],
                      [prepared.claim.encode(), prepared.claim_ttl_s, FIELD, prepared.payload, Keys.GROUP,
                       prepared.result_prefix, prepared.claim.digest, tenant, *due], pipe)


# KEYS[1] a tenant's job stream, KEYS[2..5] its band's Keys.fair_keys; ARGV field, payload, tenant, then the deadline's
# field and value where the job has one (protocol.due_fields). The job and its tenant's place in the backlog in one
# step (FAIR_JOIN_LUA).
FAIR_ENQUEUE = FAIR_JOIN_LUA + """
local id = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2], unpack(ARGV, 4))
fair_join(KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[3])
return id
"""


def fair_script(claim):
    """The fair enqueue, registered once on the client that registered the claim script."""
    script = getattr(claim, "_kvgate_fair", None)
    if script is None:
        script = claim._kvgate_fair = claim.registered_client.register_script(FAIR_ENQUEUE)
    return script


def enqueue_commands(pipe, script, prepared: list[Prepared]) -> Steps:
    """The jobs' enqueue commands in the caller's MULTI; `owners` reads their replies. A submit never lists its model
    in `{ns}:models`: only workers and operators make a model known (model_set.py), so a typo stays a 404 at the
    gateway and never grows what stats and backlog reads cost. On an asyncio cluster pipeline a script call queues
    nothing until awaited, so each is yielded in turn and the commands keep their order (a command that queued
    itself is not: awaiting a pipeline would execute it)."""
    for p in prepared:
        queued = add_to_pipeline(pipe, script, p)
        if inspect.iscoroutine(queued):
            yield lambda queued=queued: queued


def send(r, script, prepared: list[Prepared], keys: Keys, replies: list | None = None) -> Steps:
    """Enqueue in one MULTI: all or nothing. On a cluster, one MULTI per shard: all or nothing per shard (a refusal
    in a later shard leaves the earlier shards' jobs enqueued, and raises: `replies`, when given, then holds those
    jobs' replies and None for the others, for the caller to take them back)."""
    replies = [None] * len(prepared) if replies is None else replies
    if len(keys.parts) == 1:
        pipe = r.pipeline(transaction=True)  # all or nothing: an OOM refusal aborts the whole EXEC
        yield from enqueue_commands(pipe, script, prepared)
        replies[:] = yield pipe.execute
        return replies
    for group in by_shard(prepared, keys):
        pipe = r.pipeline(transaction=True)
        yield from enqueue_commands(pipe, script, [prepared[i] for i in group])
        for i, reply in zip(group, (yield pipe.execute)):
            replies[i] = reply
    return replies


def send_riding_failovers(r, script, prepared: list[Prepared], keys: Keys, budget_s: float,
                          replies: list | None = None) -> Steps:
    """`send`; on a cluster, sent again while a primary is down (its replica takes over within seconds), up to
    `budget_s`. Safe to repeat: an entry sent twice carries the same job id, and the finish script answers a job
    id once (a claim, when there is one, finds its own job)."""
    if not keys.cluster:
        return (yield from send(r, script, prepared, keys, replies))
    return (yield from across_failover(lambda: send(r, script, prepared, keys, replies), budget_s))


def across_failover(steps_of, budget_s: float = FAILOVER_BUDGET_S, first_wait_s: float = 0.05) -> Steps:
    """Run idempotent steps (`steps_of()` makes them anew) again while the primary is unreachable or demoted (a
    failover in progress), up to `budget_s`; then the last error goes to the caller."""
    deadline, wait = time.monotonic() + budget_s, first_wait_s
    while True:
        try:
            return (yield from steps_of())
        except FAILOVER_ERRORS:
            if time.monotonic() + wait > deadline:
                raise
            yield Sleep(wait)
            wait = min(wait * 2, 1.0)


def by_shard(prepared: list[Prepared], keys: Keys) -> list[list[int]]:
    """Indexes of `prepared` grouped by shard: one MULTI each on a cluster (a MULTI touches one slot)."""
    return keys.by_shard(range(len(prepared)), lambda i: prepared[i].stream)


def new_models(prepared: list[Prepared], grouped: set[str]) -> list[str]:
    """Models of these jobs whose streams this client has not yet given the workers' group."""
    return sorted({p.model for p in prepared} - grouped)


def owners(prepared: list[Prepared], replies: list) -> list[Claim]:
    """Who owns each submitted job (us, or an earlier submit with the same idempotency key) and its entry id."""
    out = []
    for p, reply in zip(prepared, replies):
        if p.claim is None:
            entry = reply.decode() if isinstance(reply, bytes) else str(reply)
            out.append(Claim(p.job.job_id, "", owner_tag(p.job.client_id), entry))
        else:
            out.append(resolve(p.job.idempotency_key, p.claim, reply))
    return out


def claim_script(r):
    return r.register_script(CLAIM_AND_ENQUEUE)


def group_commands(pipe, streams: list[str]) -> None:
    """Create the workers' group at id 0, so jobs added before any worker of their model exists are not
    skipped, and stats count them as backlog."""
    for stream in streams:
        pipe.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)


def check_group_replies(replies: list, exists: list[bool] | None = None) -> None:
    """Creating a group that exists is fine; so is a refused creation (out of memory, read-only replica) of a
    group that `exists` says is there already: a client must start while Redis is full."""
    for i, reply in enumerate(replies):
        if not isinstance(reply, Exception) or "BUSYGROUP" in str(reply):
            continue
        if exists is not None and exists[i] and refusal_of(reply) is not None:
            continue
        raise reply


def group_exists(reply) -> bool:
    """From an XINFO GROUPS reply (or its error): does the workers' group exist?"""
    if isinstance(reply, Exception):
        return False
    return any(as_text(g.get("name")) == Keys.GROUP for g in reply)


@dataclass(slots=True)
class BacklogGate:
    """Client(max_backlog=N): reads the backlog at most every `every_s`, so submit stays cheap. Concurrent submits (an
    AsyncClient serving many requests) share one read in flight, and each admitted job is counted from the moment it
    passes the gate, not once its enqueue returns: a burst arriving together can neither start one read each nor
    all pass on the same stale count."""

    max_backlog: int | None
    mode: str = "raise"
    every_s: float = 0.1
    _checked_at: float = float("-inf")
    _backlog: int = 0  # the last read, plus our jobs enqueued since
    _reserved: int = 0  # jobs past the gate whose enqueue has not returned yet
    _reading: bool = False
    _added_while_reading: int = 0  # the read under way may have missed them: counted on top of it

    def __post_init__(self):
        if self.mode not in ("raise", "wait"):
            raise ValueError(f"backpressure={self.mode!r} must be 'raise' or 'wait'")
        if self.max_backlog is not None and self.max_backlog < 1:
            raise ValueError(f"max_backlog={self.max_backlog} must be a positive number of jobs or None")

    def stale(self) -> bool:
        return self.max_backlog is not None and time.monotonic() - self._checked_at >= self.every_s

    def claim_read(self) -> bool:
        """True for the one caller that should read the backlog now; the others go on with the count they have."""
        if self._reading or not self.stale():
            return False
        self._reading, self._added_while_reading = True, 0
        return True

    def record(self, backlog: int) -> None:
        self._checked_at, self._backlog = time.monotonic(), backlog + self._added_while_reading
        self._reading = False

    def read_failed(self) -> None:
        self._reading = False

    def blocked(self, n: int = 1) -> bool:
        """Whether n more jobs would pass the limit: an admission is counted whole, never let in part."""
        return self.max_backlog is not None and self._backlog + self._reserved + n > self.max_backlog

    def never_fits(self, n: int) -> FieldError | None:
        """An admission of more jobs than the whole limit: no wait can let it in."""
        if self.max_backlog is None or n <= self.max_backlog:
            return None
        return FieldError("requests", n, f"{n} jobs in one admission are over the whole max_backlog="
                                         f"{self.max_backlog}, so no wait can admit them: send at most "
                                         f"{self.max_backlog} at a time, or raise max_backlog")

    def reserve(self, n: int) -> None:
        self._reserved += n

    def settle(self, n: int, enqueued: bool) -> None:
        """The enqueue of n reserved jobs returned: between reads, count our own jobs (so a burst cannot overshoot
        the limit), or release them when it failed."""
        self._reserved -= n
        if enqueued:
            self._backlog += n
            if self._reading:
                self._added_while_reading += n

    def refuse(self, n: int = 1) -> Backpressure:
        return Backpressure(self._backlog + self._reserved, self.max_backlog, n)

    def force(self) -> None:
        self._checked_at = float("-inf")
