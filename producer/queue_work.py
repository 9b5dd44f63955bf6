"""The work waiting per model and priority, in tokens, and how it stands against its deadlines: what the exporter
publishes for autoscaling on work rather than on job counts (docs/operations/autoscaling.md).

Bounded cost, whatever the backlog: a stream's entries are never all read. For each job stream with a backlog
(shared, lanes, shards) the SAMPLE entries served next (those parked for deadline order, earliest due first, then
those just after the group's last-delivered id) and the SAMPLE entries enqueued last are read, in one pipelined
round trip for all streams (and one more for the parked ones' entries); each is decoded and costed as a quota
charge is (`estimate_tokens`: prompt token ids or characters / 4, plus max_tokens). With the backlog at most
2 x SAMPLE the two ends cover it and the figures are exact; past that, the unread middle is counted at the sampled
jobs' mean. With fair share, the streams of each band's TOP_TENANTS tenants served next are sampled the same way;
the band's other tenants' jobs count at the mean of what was sampled (UNSAMPLED_JOB_TOKENS when nothing was): their
number is queue_stats' backlog, which counts them by their band's counter. So a scrape reads at most 3 x SAMPLE
entries a stream (2 x SAMPLE where nothing is parked): 1e6 jobs waiting cost what 200 do, and 1e5 tenants what 10 do.

Deadline slack is measured on the sampled jobs only: for each job with a deadline, the tokens that must drain before
it ends (every higher priority's, its stream's ahead of it, scaled to every stream of its priority, and its own)
against the time to its deadline on the Redis server's clock (invariant 9). A batch's lines share one deadline and
arrive together, so its last line (the tail sample) is its tightest; a job in the unread middle of a long backlog
with an earlier deadline than both ends is not seen.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .keys import PRIORITIES, TENANT_WINDOW_S, Keys, as_text
from .protocol import FIELD, decode_job
from .limits import TOP_TENANTS
from .queue_stats import QueueStats, WorkerStats, fair_queued, lanes_of, server_ms
from .quotas import estimate_tokens
from .steps import Steps, call, run
from .stream_rows import read_rows

SAMPLE = 64  # entries read at each end of a stream's backlog per look
DUE_FLOOR_S = 60.0  # a deadline nearer than this is priced as this far (rate_needed)
UNSAMPLED_JOB_TOKENS = 512  # a job's cost when no job of its priority could be sampled (tenants' streams only)


@dataclass(slots=True)
class Sampled:
    """One sampled entry: its cost, the stream tokens ahead of it (itself excluded) and its deadline (unix s)."""

    tokens: int
    ahead: float
    deadline: float | None


@dataclass(slots=True)
class StreamWork:
    jobs: int  # backlog: entries not yet delivered
    tokens: float  # estimated, the unread middle at the sampled mean
    sampled: list[Sampled] = field(default_factory=list)


def stream_work(backlog: int, head: list[tuple[int, float | None]], tail: list[tuple[int, float | None]],
                fallback: float = UNSAMPLED_JOB_TOKENS) -> StreamWork:
    """A stream's work from its next-served `head` and last-enqueued `tail` entries (oldest first, each as (tokens,
    deadline), no entry in both); the `backlog` jobs neither holds are counted at their mean."""
    costs = [t for t, _ in head + tail]
    mean = sum(costs) / len(costs) if costs else fallback
    middle = max(0, backlog - len(head) - len(tail))
    total = sum(costs) + middle * mean
    sampled, ahead = [], 0.0
    for tokens, deadline in head:
        sampled.append(Sampled(tokens, ahead, deadline))
        ahead += tokens
    behind = 0.0
    for tokens, deadline in reversed(tail):
        behind += tokens
        sampled.append(Sampled(tokens, total - behind, deadline))
    return StreamWork(backlog, total, sampled)


@dataclass(slots=True)
class PriorityWork:
    """One model's priority: the exporter's gauges before the fleet's rate is applied."""

    priority: str
    jobs: int = 0
    tokens: float = 0.0
    tokens_through: float = 0.0  # this priority's tokens and every higher one's: what drains before it is done
    # per sampled job with a deadline: (tokens that drain before it ends, seconds to its deadline)
    deadlines: list[tuple[float, float]] = field(default_factory=list)

    def drain_s(self, rate: float) -> float | None:
        """Seconds to drain this priority (and those served before it) at `rate` tokens/s; None: no rate."""
        return self.tokens_through / rate if rate > 0 else None

    def least_slack_s(self, rate: float) -> float | None:
        """The least over sampled jobs of deadline - now - their drain at `rate`; None: no deadline or no rate."""
        if not self.deadlines or rate <= 0:
            return None
        return min(left - ahead / rate for ahead, left in self.deadlines)

    def rate_needed(self, floor_s: float = DUE_FLOOR_S) -> float:
        """The least fleet rate (tokens/s) at which every sampled job ends by its deadline; 0: no deadline waits.
        A job past its deadline asks for nothing (a worker answers it `expired` without running it), and one due
        within `floor_s` counts as due in `floor_s`: no fleet grows faster than a pod starts, and a job a second from
        its deadline must not ask for the largest fleet there is."""
        return max((ahead / max(left, floor_s) for ahead, left in self.deadlines if left > 0), default=0.0)


@dataclass(slots=True)
class ModelWork:
    """A model as its workers serve it (queue_stats.ServedStats): its own streams' work and its LoRA adapters', at the
    rate its workers serve them all (they report an adapter's tokens as their model's)."""

    model: str
    priorities: dict[str, PriorityWork]
    tokens_per_s: float  # prompt plus generated tokens of jobs finished over the workers' last minute
    kv_usage: float | None  # used share of the live workers' KV blocks; None: no live worker


def fleet_rate(workers: list[WorkerStats], model: str) -> float:
    """Tokens/s over the workers' last minute (their per-tenant rows: prompt plus generated of finished jobs)."""
    return sum(row[1] for w in workers if model in w.models for row in w.tenants.values()) / TENANT_WINDOW_S


def kv_usage(workers: list[WorkerStats], model: str) -> float | None:
    total = sum(w.total_blocks for w in workers if model in w.models)
    return 1.0 - sum(w.free_blocks for w in workers if model in w.models) / total if total else None


def _cost(fields: dict) -> tuple[int, float | None] | None:
    """An entry's (tokens, deadline); None: not a job this build reads (the worker answers it with an error)."""
    payload = fields.get(FIELD.encode(), fields.get(FIELD))
    try:
        job = decode_job(payload)
    except Exception:  # noqa: BLE001 - a producer's bad entry is skipped here, never the scrape's failure
        return None
    return estimate_tokens(job), job.deadline


def _costs(entries) -> list[tuple[int, float | None]]:
    return [c for _, fields in entries if (c := _cost(fields)) is not None]


def sample_streams(r, keys: Keys, streams: list[str]) -> Steps:
    """Each stream's StreamWork: two reads of at most SAMPLE entries each, pipelined over every stream, and the first
    SAMPLE entries parked for deadline order (worker/due.py), which are served next: their ids from the due index
    in the first round trip, their entries in a second."""
    rows = yield from read_rows(r, keys, streams)
    pipe, asked = r.pipeline(transaction=False), []
    for stream, row in rows.items():
        backlog = row.lag if row.lag is not None else row.length  # 6.2: bounded by the samples below anyway
        if not backlog and not row.parked:
            continue
        after = f"({row.last_delivered}" if row.last_delivered else "-"
        pipe.xrange(stream, min=after, max="+", count=SAMPLE)
        pipe.xrevrange(stream, max="+", min=after, count=SAMPLE)
        pipe.zrange(keys.due_index(stream), 0, SAMPLE - 1)
        asked.append(stream)
    replies = (yield call(pipe.execute, raise_on_error=False)) if asked else []
    parked = {stream: [Keys.due_entry_id(m) for m in _entries(replies[3 * i + 2])] for i, stream in enumerate(asked)}
    pipe = r.pipeline(transaction=False)
    for stream, ids in parked.items():
        for entry_id in ids:
            pipe.xrange(stream, min=entry_id, max=entry_id)
    found = iter((yield call(pipe.execute, raise_on_error=False)) if any(parked.values()) else [])
    out = {}
    for i, stream in enumerate(asked):
        head, tail = (_entries(reply) for reply in replies[3 * i:3 * i + 2])
        seen = {as_text(i) for i, _ in head}
        tail = [e for e in reversed(tail) if as_text(e[0]) not in seen]
        first = [e for _ in parked[stream] for e in _entries(next(found))]  # in due order; gone: trimmed since
        row = rows[stream]
        backlog = row.lag if row.lag is not None else _backlog_62(head, tail)
        out[stream] = stream_work(backlog + row.parked, _costs(first + head), _costs(tail))
    return out


def _entries(reply) -> list:
    """A read's entries; a key a producer made of another type holds none, any other error (a user without XRANGE or
    XREVRANGE) is the caller's."""
    if isinstance(reply, Exception):
        if "WRONGTYPE" in str(reply):
            return []
        raise reply
    return reply


def _backlog_62(head, tail) -> int:
    """Redis 6.2 keeps no lag: exact when both ends meet, else at least what was read (queue_stats pages the count
    for the lag gauge; the work gauges stay bounded)."""
    return len(head) + len(tail) if len(head) < SAMPLE else max(len(head) + len(tail), 2 * SAMPLE)


def priority_work(streams: dict[str, StreamWork], names: list[str], jobs: int, above: float,
                  priority: str, now_s: float) -> PriorityWork:
    """One model's priority over its `names` streams, with `jobs` waiting in all (queue_stats' backlog: tenants'
    streams and lanes included); `above`: tokens of the priorities served before it."""
    parts = [streams[n] for n in names if n in streams]
    sampled = [s for p in parts for s in p.sampled]
    mean = sum(s.tokens for s in sampled) / len(sampled) if sampled else UNSAMPLED_JOB_TOKENS
    work = PriorityWork(priority, jobs=jobs)
    work.tokens = sum(p.tokens for p in parts) + max(0, jobs - sum(p.jobs for p in parts)) * mean
    work.tokens_through = above + work.tokens
    for p in parts:
        share = work.tokens / p.tokens if p.tokens else 1.0  # the other streams drain alongside this one
        work.deadlines += [(above + (s.ahead + s.tokens) * share, s.deadline - now_s)
                           for s in p.sampled if s.deadline is not None]
    return work


def next_tenants(r, keys: Keys, names: list[str]) -> Steps:
    """Fair share: per band (model, priority, shard) with jobs queued in tenants' streams, the streams of the
    TOP_TENANTS tenants served next (the lowest virtual counters): sampled as shared streams are, so their jobs'
    tokens and deadlines are seen, whatever the number of tenants."""
    queued = yield from fair_queued(r, keys, names)
    bands = [band for band, n in queued.items() if n > 0]
    if not bands:
        return {}
    pipe = r.pipeline(transaction=False)
    for band in bands:
        pipe.zrange(Keys.fair_backlog(band), 0, TOP_TENANTS - 1)
    replies = yield call(pipe.execute, raise_on_error=False)
    return {band: [Keys.tenant_jobs(band, as_text(t)) for t in _entries(reply)] for band, reply in zip(bands, replies)}


def queue_work(r, keys: Keys, snap: QueueStats) -> Steps:
    """Every model `snap` (queue_stats') has workers serve, its adapters folded in (QueueStats.served): its
    priorities' work over its own streams and its adapters' (a priority's streams drain alongside each other, after
    every higher priority's of them all), its fleet's rate and KV use."""
    now_s, lanes = (yield from server_ms(r)) / 1000, (yield from lanes_of(r, keys))
    names = sorted(snap.models)
    tenants = yield from next_tenants(r, keys, names)
    shared = [st for m in names for st in keys.all_jobs(m, lanes)]
    streams = yield from sample_streams(r, keys, shared + [st for band in tenants.values() for st in band])
    out = {}
    for model, served in snap.served.items():
        above, priorities = 0.0, {}
        for p in PRIORITIES:
            own = [st for m in served.names for st in keys.job_streams(m, p, lanes)]
            own += [st for m in served.names for k in range(len(keys.parts))
                    for st in tenants.get(keys.jobs(m, p, shard=k), [])]
            work = priority_work(streams, own, served.priorities[p].backlog, above, p, now_s)
            priorities[p], above = work, work.tokens_through
        out[model] = ModelWork(model, priorities, fleet_rate(snap.workers, model), kv_usage(snap.workers, model))
    return out


def read_queue_work(r, keys: Keys, snap: QueueStats) -> dict[str, ModelWork]:
    """`queue_work` on a blocking client: the exporter's."""
    return run(queue_work(r, keys, snap))
