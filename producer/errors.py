"""Typed errors of the producer SDK. Each says what was wrong, with which value, and what to do."""
from __future__ import annotations

from dataclasses import dataclass

from .quoting import shown


class KvgateError(Exception):
    """Base class of every error the SDK raises on purpose."""


@dataclass(slots=True, frozen=True)
class FieldError:
    field: str
    value: object
    reason: str

    def __str__(self) -> str:
        return f"{self.field}={shown(self.value)}: {self.reason}"


LISTED_ERRORS = 5  # of an InvalidRequest's errors, in its message


class InvalidRequest(KvgateError, ValueError):
    """A submit argument failed validation; nothing was enqueued."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        first = errors[0]
        self.field, self.value, self.reason = first.field, first.value, first.reason
        # a few, each value shown short: 200,000 bad logit_bias values made an 11 MB message (issue 45.7)
        listed = "; ".join(str(e) for e in errors[:LISTED_ERRORS])
        if len(errors) > LISTED_ERRORS:
            listed += f"; and {len(errors) - LISTED_ERRORS:,} more in .errors"
        super().__init__(f"invalid request ({listed}); fix the argument and submit again, nothing was enqueued")


class Backpressure(KvgateError):
    """The fleet's backlog, with the `requested` jobs of this admission, would pass the client's max_backlog."""

    def __init__(self, backlog: int, max_backlog: int, requested: int = 1):
        self.backlog, self.max_backlog, self.requested = backlog, max_backlog, requested
        over = "is at or over" if requested <= 1 else f"plus the {requested} of this call would pass"
        super().__init__(f"backlog of {backlog} jobs {over} max_backlog={max_backlog}; retry later, "
                         "add workers, or create the Client with backpressure='wait'")


class QuotaExceeded(Backpressure):
    """A tenant is at its quota: `ceiling` is "max_jobs" (jobs queued or running) or "tokens_per_minute"."""

    def __init__(self, tenant: str, ceiling: str, limit: int, used: int, requested: int, retry_after_s: float):
        self.tenant, self.ceiling, self.limit, self.used, self.requested = tenant, ceiling, limit, used, requested
        self.retry_after_s = retry_after_s
        self.backlog, self.max_backlog = used, limit
        what = "jobs queued or running" if ceiling == "max_jobs" else "tokens in the last minute"
        advice = f"retry after {retry_after_s:g} s, or raise the tenant's quota"
        if requested > limit:  # waiting never helps
            advice = ("this call alone is over it, so retrying cannot help: send fewer jobs (or, for tokens, a lower "
                      "max_tokens or shorter prompts), or raise the tenant's quota")
        KvgateError.__init__(self, f"tenant {tenant!r} has {used} {what} and asks for {requested} more, over its "
                                   f"{ceiling}={limit}; {advice}")


class IdempotencyConflict(KvgateError):
    """An idempotency key was reused with a different request body."""

    def __init__(self, key: str, job_id: str):
        self.key, self.job_id = key, job_id
        super().__init__(f"idempotency_key={key!r} already belongs to job {job_id} with a different request body; "
                         "use a new key for a different request")


class ResultTimeout(KvgateError, TimeoutError):
    """No final result arrived in time; the job may still finish (see Client.get)."""

    def __init__(self, job_id: str, timeout: float):
        self.job_id, self.timeout = job_id, timeout
        super().__init__(f"job {job_id} has no result after {timeout:g} s; wait longer, or fetch it later "
                         "with Client.get(job_id)")


class ConnectionFailed(KvgateError, ConnectionError):
    """Redis could not be reached; the URL is shown with its password masked."""

    def __init__(self, url: str, cause: BaseException | str):
        self.url, self.cause = url, cause
        super().__init__(f"cannot reach Redis at {url}: {cause}; check that it runs (`kvgate redis` starts one) "
                         "and that the URL and credentials are right")


class NotReplicatedError(ConnectionFailed):
    """durability="replicated": no replica acknowledged the write before failover_budget_s ran out."""

    def __init__(self, url: str, cause: BaseException | str):
        self.url, self.cause = url, cause
        KvgateError.__init__(self, f"Redis at {url} kept the write on its primary only: {cause}. It may still be "
                             "enqueued and run (resubmitting with the same idempotency_key is safe); check that a "
                             "replica is connected (INFO replication) or raise replica_timeout_ms")


class ServerRefused(KvgateError):
    """Redis refused a write: out of memory (maxmemory with noeviction) or a read-only replica after a failover."""

    def __init__(self, url: str, reason: str, advice: str, enqueued: str = "nothing of this call was enqueued"):
        self.url, self.reason = url, reason
        super().__init__(f"Redis at {url} refused the write: {reason}; {enqueued}. {advice}")


class PartiallySubmitted(KvgateError):
    """submit_many enqueued some chunks of its requests before Redis refused one; says exactly which."""

    def __init__(self, handles: list, total: int, cause: KvgateError):
        self.handles, self.total, self.cause = handles, total, cause
        self.not_enqueued = list(range(len(handles), total))
        super().__init__(f"requests[0:{len(handles)}] were enqueued (their handles are in .handles) and "
                         f"requests[{len(handles)}:{total}] were not: {cause}. Resubmit only the requests listed in "
                         ".not_enqueued; resubmitting all would run the first ones twice")


class JobFailed(KvgateError):
    """A call that returns a job's answer rather than its Result (Client.embed) found the job not done: its result
    (status error, expired or cancelled, with the worker's reason) is in .result."""

    def __init__(self, result):
        self.result = result
        super().__init__(f"job {result.job_id} ended {result.status}: {result.error or 'no reason given'}")


class JobLost(KvgateError):
    """The job is in no job stream, pending on no worker and has no result: it will never finish."""

    def __init__(self, job_id: str, reason: str):
        self.job_id, self.reason = job_id, reason
        super().__init__(f"job {job_id} was lost: {reason}; it will not finish, submit it again")
