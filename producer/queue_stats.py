"""Backlog, pending and live workers per queue, read from Redis by any process.

Per model: every name in `{ns}:models` (each model a worker served or an operator added: model_set.py), the names
live workers serve and `default`, each with its three priority streams and their lanes; workers list the names they
serve in their heartbeats, so a known model with a backlog and no live worker shows as waiting for the autoscaler.
Names a producer invents are never read: what a read costs grows with the fleet's models, not with theirs.

Shared by Client.stats(), AsyncClient.stats(), `kvgate stats`, `kvgate top` and the exporter: step functions
(steps.py) over a redis.Redis or a redis.asyncio.Redis and Keys; read_queue_stats and total_backlog run them on a
blocking client. Lag (entries not yet delivered to the group) comes from XINFO GROUPS on
Redis 7. Redis 6.2 has no `lag` there (and 7 reports none after some deletions), so it is counted
from the group's last-delivered-id: lag = XLEN - entries with id <= last-delivered-id when that side
is smaller (streams are trimmed behind acks, so it usually is), else the entries after it, paging
both sides in turn so the cost is the smaller of the two, never the whole stream.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import redis

from .adapter_view import AdaptersView, WorkerLoras, adapters_view, parse_worker_loras
from .lanes import parse_lanes
from .loras import Lora, list_loras
from .model_set import known_models
from .keys import PRIORITIES, Keys, as_text
from .quotas import TenantsUsage, tenant_usage
from .steps import Steps, call, run
from .stream_rows import StreamRow, read_rows
from .tenant_view import TenantsView, parse_tenants, tenant_backlogs, tenants_view

COUNT_PAGE = 5_000


@dataclass(slots=True)
class PriorityStats:
    priority: str
    length: int = 0  # XLEN
    backlog: int = 0  # lag: not yet delivered to any worker
    pending: int = 0  # delivered to a worker, not yet acknowledged
    oldest_age_s: float | None = None  # oldest undelivered or pending entry, by its id's timestamp

    def add(self, other: "PriorityStats") -> None:
        """Sum `other`'s streams into these (a priority over models, or over a model's adapters)."""
        self.length, self.backlog, self.pending = (self.length + other.length, self.backlog + other.backlog,
                                                   self.pending + other.pending)
        self.oldest_age_s = _oldest([self.oldest_age_s, other.oldest_age_s])


@dataclass(slots=True)
class WorkerStats:
    worker_id: str
    model: str = ""  # canonical name
    models: list[str] = field(default_factory=list)  # every name it serves: canonical, aliases, `default`
    state: str = "serving"
    running: int = 0
    waiting: int = 0
    max_num_seqs: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 0
    admissible_tokens: int = 0
    tokens_per_s: float = 0.0
    jobs_done: int = 0
    heartbeat_age_s: float | None = None
    tenants: dict[str, list[int]] = field(default_factory=dict)  # tenant_view.parse_tenants of its heartbeat
    loras: WorkerLoras | None = None  # its adapter slots (adapter_view.parse_worker_loras); None: it has none

    @property
    def free_kv_tokens(self) -> int:
        return self.free_blocks * self.block_size

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


def _oldest(ages) -> float | None:
    ages = [a for a in ages if a is not None]
    return max(ages) if ages else None


class PrioritySums:
    """A row's figures over its priorities, and its JSON: one definition for a name's row (ModelStats) and a served
    model's (ServedStats), which `kvgate stats --json` prints. Needs `priorities`, `workers`, `waiting_for_workers`."""

    __slots__ = ()

    @property
    def backlog(self) -> int:
        return sum(p.backlog for p in self.priorities.values())

    @property
    def pending(self) -> int:
        return sum(p.pending for p in self.priorities.values())

    @property
    def oldest_age_s(self) -> float | None:
        return _oldest(p.oldest_age_s for p in self.priorities.values())

    def to_dict(self) -> dict:
        return {"priorities": {k: asdict(v) for k, v in self.priorities.items()}, "workers": self.workers,
                "backlog": self.backlog, "pending": self.pending, "oldest_age_s": self.oldest_age_s,
                "waiting_for_workers": self.waiting_for_workers}


@dataclass(slots=True)
class ModelStats(PrioritySums):
    model: str
    priorities: dict[str, PriorityStats] = field(default_factory=dict)
    workers: list[str] = field(default_factory=list)  # live workers serving this name (aliases included)
    adapter_of: str | None = None  # a registered LoRA adapter's base model; None: a model

    @property
    def served_by(self) -> str:
        """The model whose workers serve these streams: an adapter's base, else the name itself (`ServedStats`)."""
        return self.adapter_of or self.model

    @property
    def waiting_for_workers(self) -> bool:
        """Jobs wait and no live worker serves the model: only a scale-up (from zero) will answer them."""
        return not self.workers and (self.backlog > 0 or self.pending > 0)


@dataclass(slots=True)
class ServedStats(PrioritySums):
    """A model as its workers serve it: its own streams and every registered LoRA adapter's of it, summed per
    priority: the per-model rows of the exporter, `kvgate stats` and `kvgate top`, so they agree. Adapters are
    registered at run time, hundreds of them, so a row each would break the rule of every per-name view
    (limits.top_and_rest); one adapter alone is the adapter view's."""

    model: str
    names: list[str]  # the names whose streams it sums: the model's own (if known or served) and its adapters'
    priorities: dict[str, PriorityStats]
    workers: list[str]  # live workers serving any of them
    waiting_for_workers: bool  # one of its names has jobs waiting and no live worker serving it (ModelStats')


def served_models(models: dict[str, ModelStats]) -> dict[str, ServedStats]:
    """`models` (queue_stats' per name) folded by the model serving each: an adapter's rows into its base's. An
    adapter's jobs wait for workers while no live worker of its base has adapter slots, though its base has
    workers: the folded row says so."""
    out: dict[str, ServedStats] = {}
    for m in models.values():
        row = out.setdefault(m.served_by, ServedStats(m.served_by, [], {p: PriorityStats(p) for p in PRIORITIES},
                                                      [], False))
        row.names.append(m.model)
        row.workers += [w for w in m.workers if w not in row.workers]
        row.waiting_for_workers |= m.waiting_for_workers
        for p, s in m.priorities.items():
            row.priorities[p].add(s)
    return dict(sorted(out.items()))


@dataclass(slots=True)
class QueueStats:
    models: dict[str, ModelStats] = field(default_factory=dict)
    workers: list[WorkerStats] = field(default_factory=list)
    dead: int = 0
    tenants: TenantsUsage = field(default_factory=TenantsUsage)  # jobs and tokens under quotas, busiest first
    tenant_view: TenantsView = field(default_factory=TenantsView)  # backlog, running, tokens, queue wait per tenant
    adapters: AdaptersView = field(default_factory=AdaptersView)  # backlog, pending, wait, workers per LoRA adapter

    @property
    def priorities(self) -> dict[str, PriorityStats]:
        """Each priority summed over all models."""
        out = {p: PriorityStats(p) for p in PRIORITIES}
        for m in self.models.values():
            for p, s in m.priorities.items():
                out[p].add(s)
        return out

    @property
    def served(self) -> dict[str, ServedStats]:
        """Per model its workers serve, its adapters' streams summed in (served_models): the per-model rows of the
        exporter, `kvgate stats` (and its --json's `models`) and `kvgate top`."""
        return served_models(self.models)

    @property
    def backlog(self) -> int:
        return sum(m.backlog for m in self.models.values())

    @property
    def pending(self) -> int:
        return sum(m.pending for m in self.models.values())

    @property
    def free_kv_tokens(self) -> int:
        return sum(w.free_kv_tokens for w in self.workers)

    @property
    def oldest_age_s(self) -> float | None:
        return _oldest(m.oldest_age_s for m in self.models.values())

    def to_dict(self) -> dict:
        """`kvgate stats --json`. `models` holds the served rows, an adapter's jobs in its base's (the exporter's
        figures); one adapter alone is in `adapters` (top 10 and `_other`), so the object stays bounded."""
        return {"models": {k: v.to_dict() for k, v in self.served.items()},
                "priorities": {k: asdict(v) for k, v in self.priorities.items()},
                "workers": [{k: v for k, v in asdict(w).items() if k != "tenants"} |
                            {"free_kv_tokens": w.free_kv_tokens, "kv_usage": w.kv_usage} for w in self.workers],
                "backlog": self.backlog, "pending": self.pending, "dead": self.dead,
                "free_kv_tokens": self.free_kv_tokens, "oldest_age_s": self.oldest_age_s,
                "tenants": self.tenants.to_dict(), "tenant_view": self.tenant_view.to_dict(),
                "adapters": self.adapters.to_dict()}


def _id_ms(entry_id) -> int:
    return int(as_text(entry_id).split("-")[0])


def server_ms(r) -> Steps:
    """The server's clock, the one stream ids are stamped with, so ages ignore client clock skew."""
    seconds, micros = yield call(r.time)
    return seconds * 1000 + micros // 1000


def count_lag(r, stream: str, last_delivered: str, length: int) -> Steps:
    """Entries after last_delivered, paging from both ends of it so the cost is the smaller side."""
    before = after = 0
    lo, hi = "-", f"({last_delivered}"
    while True:
        page = yield call(r.xrange, stream, min=lo, max=last_delivered, count=COUNT_PAGE)
        before += len(page)
        if len(page) < COUNT_PAGE:
            return max(0, length - before)
        lo = f"({as_text(page[-1][0])}"
        page = yield call(r.xrange, stream, min=hi, max="+", count=COUNT_PAGE)
        after += len(page)
        if len(page) < COUNT_PAGE:
            return after
        hi = f"({as_text(page[-1][0])}"


def lag_of(r, stream: str, row: StreamRow) -> Steps:
    """A stream's entries waiting: not yet delivered to the workers' group (counted here where the server has no
    lag), and those parked for deadline order (delivered to no worker: worker/due.py)."""
    if row.lag is not None:
        return row.lag + row.parked
    return (yield from count_lag(r, stream, row.last_delivered, row.length)) + row.parked


def lanes_of(r, keys: Keys) -> Steps:
    return parse_lanes((yield call(r.get, keys.lanes())))


def backlog(r, keys: Keys) -> Steps:
    """Across all known models and their lanes: Client(max_backlog=...) bounds what the whole fleet has waiting. One
    script call per shard, whatever the number of streams."""
    lanes = yield from lanes_of(r, keys)
    models = yield from known_models(r, keys)
    streams = [st for m in models for st in keys.all_jobs(m, lanes)]
    total = sum((yield from fair_queued(r, keys, models)).values())
    for stream, row in (yield from read_rows(r, keys, streams)).items():
        total += yield from lag_of(r, stream, row)
    return total


def fair_queued(r, keys: Keys, models: list[str]) -> Steps:
    """Jobs waiting in tenants' streams (fair share), per band: one counter each, whatever the tenants."""
    bands = [keys.jobs(m, p, shard=k) for m in models for p in PRIORITIES for k in range(len(keys.parts))]
    pipe = r.pipeline(transaction=False)
    for band in bands:
        pipe.get(Keys.fair_queued(band))
    replies = yield call(pipe.execute, raise_on_error=False)
    return {band: max(0, int(reply)) for band, reply in zip(bands, replies)
            if reply is not None and not isinstance(reply, Exception) and as_text(reply).lstrip("-").isdigit()}


def total_backlog(r: redis.Redis, keys: Keys) -> int:
    """`backlog` on a blocking client."""
    return run(backlog(r, keys))


def read_priority(r, keys: Keys, model: str, priority: str, now_ms: int, lanes: int,
                  rows: dict[str, StreamRow], queued: dict[str, int] | None = None) -> Steps:
    """One model's priority over its shared stream and every lane: sums, and the oldest job of them all; with fair
    share, the jobs its tenants' streams hold (`queued`: per band) count in its length and backlog."""
    stats = PriorityStats(priority)
    for stream in keys.job_streams(model, priority, lanes):
        waiting = (queued or {}).get(stream, 0)
        stats.length += waiting
        stats.backlog += waiting
        part = yield from read_stream(r, stream, priority, now_ms, rows[stream])
        stats.length += part.length
        stats.backlog += part.backlog
        stats.pending += part.pending
        if part.oldest_age_s is not None:
            stats.oldest_age_s = max(stats.oldest_age_s or 0.0, part.oldest_age_s)
    return stats


def read_stream(r, stream: str, priority: str, now_ms: int, row: StreamRow) -> Steps:
    stats = PriorityStats(priority, length=row.length)
    if row.length == 0:
        return stats
    stats.backlog, stats.pending = (yield from lag_of(r, stream, row)), row.pending - row.parked
    oldest = [_id_ms(entry) for entry in (row.oldest_pending, row.next_undelivered) if entry]
    if oldest:
        stats.oldest_age_s = max(0.0, (now_ms - min(oldest)) / 1000)
    return stats


def _number(fields: dict[str, str], name: str, kind=int):
    try:
        return kind(float(fields.get(name, 0) or 0))
    except ValueError:
        return kind(0)


def parse_heartbeat(raw: dict, now_ms: int) -> WorkerStats:
    f = {as_text(k): as_text(v) for k, v in raw.items()}
    updated = _number(f, "updated_at", float)
    ints = {n: _number(f, n) for n in ("running", "waiting", "max_num_seqs", "free_blocks", "total_blocks",
                                       "block_size", "admissible_tokens", "jobs_done")}
    model = f.get("model", "")
    models = [m for m in f.get("models", "").split(",") if m] or ([model] if model else [])
    return WorkerStats(worker_id=f.get("worker_id", "?"), model=model, models=models, state=f.get("state", "serving"),
                       tokens_per_s=_number(f, "tokens_per_s", float),
                       heartbeat_age_s=max(0.0, now_ms / 1000 - updated) if updated else None,
                       tenants=parse_tenants(f.get("tenants", "")), loras=parse_worker_loras(f.get("loras", "")),
                       **ints)


def read_workers(r, keys: Keys, now_ms: int) -> Steps:
    """The registry's members whose heartbeat has not expired; a hash that expired since is skipped."""
    ids = sorted(as_text(i) for i in (yield call(r.zrangebyscore, keys.workers(), now_ms, "+inf")))
    pipe = r.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hgetall(keys.worker(worker_id))
    return [parse_heartbeat(raw, now_ms) for raw in (yield pipe.execute) if raw]


def serving(workers: list[WorkerStats], model: str, loras: dict[str, Lora]) -> list[str]:
    """The live workers serving `model`: those naming it, and for a registered LoRA adapter the workers of its base
    with adapter slots, which read its streams (worker/adapters.py) though their heartbeats do not name it."""
    base = loras[model].base if model in loras else None
    return [w.worker_id for w in workers if model in w.models or (base in w.models and w.loras is not None)]


def read_model(r, keys: Keys, model: str, serving: list[str], now_ms: int, lanes: int,
               rows: dict[str, StreamRow], queued: dict[str, int] | None = None) -> Steps:
    priorities = {}
    for p in PRIORITIES:
        priorities[p] = yield from read_priority(r, keys, model, p, now_ms, lanes, rows, queued)
    return ModelStats(model, priorities, serving)


def queue_stats(r, keys: Keys) -> Steps:
    """Every known, served or registered (LoRA adapters) model's streams, read in one script call per shard."""
    now_ms, lanes = (yield from server_ms(r)), (yield from lanes_of(r, keys))
    workers = yield from read_workers(r, keys, now_ms)
    loras = yield from list_loras(r, keys)
    names = sorted(set((yield from known_models(r, keys))) | {m for w in workers for m in w.models} | set(loras))
    rows = yield from read_rows(r, keys, [st for m in names for st in keys.all_jobs(m, lanes)], oldest=True)
    queued = yield from fair_queued(r, keys, names)
    models = {}
    for m in names:
        models[m] = yield from read_model(r, keys, m, serving(workers, m, loras), now_ms, lanes, rows, queued)
        models[m].adapter_of = loras[m].base if m in loras else None
    dead = 0
    for stream in keys.deads():
        dead += yield call(r.xlen, stream)
    backlogs, other_backlog = yield from tenant_backlogs(r, keys, queued, lag_of)
    fair_on = (yield call(r.get, keys.fair())) is not None or any(queued.values())  # GET: the monitor user's
    view = tenants_view(backlogs, other_backlog, [w.tenants for w in workers], fair_on)
    return QueueStats(models=models, workers=workers, dead=dead, tenants=(yield from tenant_usage(r, keys, now_ms)),
                      tenant_view=view, adapters=adapters_view(loras, models, [w.loras for w in workers if w.loras]))


def read_queue_stats(r: redis.Redis, keys: Keys) -> QueueStats:
    """`queue_stats` on a blocking client: `kvgate stats`, `top`, the exporter, Client.stats()."""
    return run(queue_stats(r, keys))
