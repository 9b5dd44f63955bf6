"""Taking back an admission that was enqueued in part: on a Redis Cluster one admission is one MULTI per shard, and a
later shard's refusal (out of memory, a failover past its budget) leaves the earlier shards' jobs enqueued. The caller
is told the admission failed, so none of its jobs may run: each gets its cancel flag first (a worker that already read
it drops it before it starts, or at its next poll), then its entry is deleted from its stream, and a claim it holds
(an idempotency key, or durability's own) is released so that a resubmit enqueues anew instead of meeting a cancelled
job. Only this admission's fresh job ids are flagged, so an earlier job that a claim pointed at is never touched."""
from __future__ import annotations

import logging

from .keys import Keys
from .steps import Steps, call
from .submission import CANCEL_TTL_S, Prepared

log = logging.getLogger(__name__)

# KEYS[1] the claim, KEYS[2] its job's stream; ARGV[1] our job id. Released only while it names our job; its entry
# (the claim's fourth word) goes with it.
UNCLAIM = """
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
local job, entry = string.match(held, '^(%S+) %S+ %S+ (%S+)')
if job ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return redis.call('XDEL', KEYS[2], entry)
"""


def spans_shards(prepared: list[Prepared], keys: Keys) -> bool:
    """Whether enqueueing these jobs takes more than one MULTI (and so may stop half done)."""
    return len({keys.of_stream(p.stream).shard for p in prepared}) > 1


def take_back(r, prepared: list[Prepared], replies: list, keys: Keys) -> Steps:
    """Cancel and delete the jobs of `prepared` (their enqueue replies in `replies`: None where unknown); best effort,
    logged when Redis refuses (the flags still stop the jobs a worker reads)."""
    pipe = r.pipeline(transaction=False)
    for p, reply in zip(prepared, replies):
        pipe.set(keys.of_stream(p.stream).cancel(p.job.job_id), "1", ex=CANCEL_TTL_S)
        if p.claim is None and isinstance(reply, (bytes, str)):
            pipe.xdel(p.stream, reply)
    failed = [e for e in (yield call(pipe.execute, raise_on_error=False)) if isinstance(e, Exception)]
    unclaim = r.register_script(UNCLAIM)
    for p in prepared:
        if p.claim is not None:
            try:
                yield lambda p=p: unclaim(keys=[p.claim_key, p.stream], args=[p.job.job_id], client=r)
            except Exception as e:  # the claim stays until its TTL: a resubmit with its key meets a cancelled job
                failed.append(e)
    if failed:
        log.warning("taking back %d jobs of a refused admission: %d commands failed, first %r; their cancel flags stop "
                    "the jobs that have them", len(prepared), len(failed), failed[0])
