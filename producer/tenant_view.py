"""Per tenant: backlog, running jobs, tokens served and queue wait, for `kvgate stats`, `kvgate top` and the exporter.

- Backlog: only where jobs wait in tenants' streams (fair share, docs/tenants/fair-share.md). A shared stream is one
  FIFO with no per-tenant index: counting a tenant's jobs there means reading the whole backlog, so with fair share off
  the backlog is shown per model and priority only (`backlog_by_tenant` is False). With it on, each band with jobs
  queued gives the TOP_TENANTS lowest counters of its backlog set (the tenants served next) and the TOP_TENANTS
  highest (those served most: a flood), whose streams' lag is read; the band's other tenants are the band's queued
  counter minus those. So a look costs the same with 3 tenants or 100,000; with more than 2 x TOP_TENANTS tenants
  backlogged in one band, one that is neither among the next served nor among the most served counts in `other`.
- Running, tokens (prompt plus generated of jobs finished over the last TENANT_WINDOW_S) and queue wait (enqueue to
  admission on the server's clock, counts on QUEUE_WAIT_BUCKETS over the same window): from live workers'
  heartbeats (worker/tenant_load.py), each naming its TOP_TENANTS busiest and the rest summed.

Whatever the sources, the view names the TOP_TENANTS busiest (backlog plus running, then tokens) and sums every other
tenant as OTHER_TENANTS: one rule, declared in limits.py, for every view.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .keys import QUEUE_WAIT_BUCKETS, TENANT_WINDOW_S, Keys, as_text
from .limits import OTHER_TENANTS, TOP_TENANTS, top_and_rest
from .steps import Steps, call
from .stream_rows import read_rows

ROW = 3 + len(QUEUE_WAIT_BUCKETS)  # a heartbeat's row: running, tokens, one count per wait bucket and one past them


@dataclass(slots=True)
class TenantView:
    tenant: str
    backlog: int = 0  # jobs in its tenants' streams not yet delivered (fair share)
    running: int = 0  # jobs running on live workers
    tokens: int = 0  # prompt plus generated tokens of its jobs finished over the window
    waits: list[int] = field(default_factory=lambda: [0] * (len(QUEUE_WAIT_BUCKETS) + 1))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / TENANT_WINDOW_S

    def wait_quantile(self, q: float) -> float | None:
        """The queue wait below which `q` of the window's admitted jobs waited, interpolated in its bucket as
        Prometheus' histogram_quantile does; None: none admitted."""
        total = sum(self.waits)
        if not total:
            return None
        rank, seen = q * total, 0
        for i, count in enumerate(self.waits):
            if count and seen + count >= rank:
                if i == len(QUEUE_WAIT_BUCKETS):
                    return QUEUE_WAIT_BUCKETS[-1]  # past the last edge: at least that
                low = QUEUE_WAIT_BUCKETS[i - 1] if i else 0.0
                return low + (QUEUE_WAIT_BUCKETS[i] - low) * (rank - seen) / count
            seen += count
        return QUEUE_WAIT_BUCKETS[-1]

    def add(self, other: "TenantView") -> None:
        self.backlog += other.backlog
        self.running += other.running
        self.tokens += other.tokens
        self.waits = [a + b for a, b in zip(self.waits, other.waits)]

    def to_dict(self) -> dict:
        return {"tenant": self.tenant, "backlog": self.backlog, "running": self.running, "tokens": self.tokens,
                "tokens_per_s": round(self.tokens_per_s, 3), "queue_wait_p50_s": self.wait_quantile(0.5),
                "queue_wait_p99_s": self.wait_quantile(0.99)}


@dataclass(slots=True)
class TenantsView:
    top: list[TenantView] = field(default_factory=list)
    other: TenantView = field(default_factory=lambda: TenantView(OTHER_TENANTS))
    backlog_by_tenant: bool = False  # False: jobs wait in shared FIFO streams, which hold no per-tenant index

    def to_dict(self) -> dict:
        return {"top": [t.to_dict() for t in self.top], "other": self.other.to_dict(),
                "backlog_by_tenant": self.backlog_by_tenant, "window_s": TENANT_WINDOW_S}


def parse_tenants(raw: str) -> dict[str, list[int]]:
    """A heartbeat's `tenants` field: named rows past the TOP_TENANTS first are counted as OTHER_TENANTS (a worker
    writes no more, but a reader keeps its own bound); anything malformed is left out (a heartbeat never stops a
    reader)."""
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    out: dict[str, list[int]] = {}
    for tenant, row in value.items():
        if not (isinstance(row, list) and len(row) == ROW
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row)):
            continue
        name = str(tenant)[:64]
        if name != OTHER_TENANTS and len(out) - (OTHER_TENANTS in out) >= TOP_TENANTS:
            name = OTHER_TENANTS
        out[name] = [a + b for a, b in zip(out[name], row)] if name in out else row
    return out


def tenant_backlogs(r, keys: Keys, queued: dict[str, int], lag_of, top: int = TOP_TENANTS) -> Steps:
    """Per tenant the jobs not yet delivered from its streams (`lag_of`: queue_stats'), for the `top` lowest and
    highest counters of each band with jobs queued; and the jobs queued in those bands beyond them. Two pipelined
    round trips whatever the tenants (and lag counted by pages where the server keeps none: Redis 6.2)."""
    bands = [band for band, n in queued.items() if n > 0]
    if not bands:
        return {}, 0
    pipe = r.pipeline(transaction=False)
    for band in bands:
        pipe.zrange(Keys.fair_backlog(band), 0, top - 1)
        pipe.zrange(Keys.fair_backlog(band), -top, -1)
    replies = yield call(pipe.execute, raise_on_error=False)
    streams: dict[str, tuple[str, str]] = {}
    for i, band in enumerate(bands):
        for reply in replies[2 * i:2 * i + 2]:
            for tenant in ([] if isinstance(reply, Exception) else reply):
                streams[Keys.tenant_jobs(band, as_text(tenant))] = (band, as_text(tenant))
    rows = yield from read_rows(r, keys, list(streams))
    backlogs: dict[str, int] = {}
    named = 0
    for stream, row in rows.items():
        lag = yield from lag_of(r, stream, row)
        tenant = streams[stream][1]
        backlogs[tenant] = backlogs.get(tenant, 0) + lag
        named += lag
    return backlogs, max(0, sum(queued[b] for b in bands) - named)


def tenants_view(backlogs: dict[str, int], other_backlog: int, beats: list[dict[str, list[int]]],
                 backlog_by_tenant: bool, top: int = TOP_TENANTS) -> TenantsView:
    """Tenants' backlogs and workers' heartbeat rows folded into the `top` busiest and OTHER_TENANTS."""
    views: dict[str, TenantView] = {t: TenantView(t, backlog=n) for t, n in backlogs.items()}
    other = TenantView(OTHER_TENANTS, backlog=other_backlog)
    for rows in beats:
        for tenant, row in rows.items():
            part = TenantView(tenant, running=row[0], tokens=row[1], waits=list(row[2:]))
            if tenant == OTHER_TENANTS:
                other.add(part)
            else:
                views.setdefault(tenant, TenantView(tenant)).add(part)
    busy = [v for v in views.values() if v.backlog or v.running or v.tokens or any(v.waits)]
    named, rest = top_and_rest(busy, lambda v: (-(v.backlog + v.running), -v.tokens, -sum(v.waits), v.tenant), top)
    for v in rest:
        other.add(v)
    return TenantsView(named, other, backlog_by_tenant)
