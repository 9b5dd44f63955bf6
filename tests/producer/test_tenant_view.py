"""Per-tenant backlog, running jobs, tokens and queue wait (issue 27, "Visible") as `kvgate stats`, `kvgate top` and
the exporter read them: backlog from tenants' streams under fair share at a cost that does not grow with the tenants,
the rest from workers' heartbeats, summed over workers, the busiest ten by name and the rest as `_other`."""
from __future__ import annotations

import json
import time

from kvgate.commands import exporter, stats as stats_command
from kvgate.producer import Client
from kvgate.producer.keys import QUEUE_WAIT_BUCKETS, Keys
from kvgate.producer.limits import OTHER_TENANTS, TOP_TENANTS
from kvgate.producer.queue_stats import read_queue_stats
from kvgate.worker.heartbeat import write_beat

ROW = 3 + len(QUEUE_WAIT_BUCKETS)


def row(running: int = 0, tokens: int = 0, waits: dict[float, int] | None = None) -> list[int]:
    """A heartbeat's row: running, tokens, then counts per wait bucket (keyed by the bucket's upper edge)."""
    out = [running, tokens] + [0] * (ROW - 2)
    for edge, n in (waits or {}).items():
        out[2 + QUEUE_WAIT_BUCKETS.index(edge)] += n
    return out


def beat(r, keys: Keys, worker_id: str, tenants) -> None:
    write_beat(r, keys, worker_id, {"worker_id": worker_id, "model": "m", "models": "m,default",
                                    "updated_at": time.time(), "tenants": tenants if isinstance(tenants, str)
                                    else json.dumps(tenants)}, ttl_s=30)


def view_of(stats) -> dict[str, dict]:
    d = stats.tenant_view.to_dict()
    return {t["tenant"]: t for t in d["top"]} | {OTHER_TENANTS: d["other"]}


def test_backlog_per_tenant_comes_from_tenants_streams_under_fair_share(redis_server, namespace):
    r = redis_server.client()
    r.set(Keys(namespace).fair(), 1)  # the switch `kvgate worker --fair-share on` sets
    with Client(redis_server.url, namespace, tenant="flood") as a, Client(redis_server.url, namespace, tenant="b") as b:
        a.submit_many([{"prompt": "x"}] * 12, progress=False)
        b.submit_many([{"prompt": "y", "priority": "high"}] * 3, progress=False)
        got = read_queue_stats(r, a.keys)
    view = view_of(got)
    assert got.tenant_view.backlog_by_tenant
    assert view["flood"]["backlog"] == 12 and view["b"]["backlog"] == 3 and view[OTHER_TENANTS]["backlog"] == 0
    assert [t.tenant for t in got.tenant_view.top] == ["flood", "b"]  # busiest first
    text = stats_command.render(got, namespace)
    assert "flood" in text and "only with fair share" not in text


def test_the_async_sdk_reads_the_same_per_tenant_view(redis_server, namespace):
    import asyncio

    from kvgate.producer import AsyncClient

    r = redis_server.client()
    r.set(Keys(namespace).fair(), 1)
    beat(r, Keys(namespace), "w1", {"acme": row(2, 120, {0.05: 4})})

    async def go():
        async with AsyncClient(redis_server.url, namespace, tenant="acme") as client:
            await client.submit_many([{"prompt": "x"}] * 6)
            return await client.stats()

    got = asyncio.run(go())
    assert view_of(got)["acme"] | {"queue_wait_p50_s": None, "queue_wait_p99_s": None} == {
        "tenant": "acme", "backlog": 6, "running": 2, "tokens": 120, "tokens_per_s": 2.0,
        "queue_wait_p50_s": None, "queue_wait_p99_s": None}
    assert view_of(got)["acme"]["queue_wait_p50_s"] is not None


def test_without_fair_share_the_backlog_per_tenant_is_said_to_be_unknown_not_guessed(redis_server, namespace):
    r = redis_server.client()
    with Client(redis_server.url, namespace, tenant="acme") as client:
        client.submit_many([{"prompt": "x"}] * 4, progress=False)
        beat(r, client.keys, "w1", {"acme": row(running=1)})
        got = read_queue_stats(r, client.keys)
    assert got.backlog == 4 and not got.tenant_view.backlog_by_tenant
    assert view_of(got)["acme"]["backlog"] == 0 and view_of(got)["acme"]["running"] == 1
    text = stats_command.render(got, namespace)
    assert "backlog per tenant: only with fair share on" in text
    families = {f.name: f for f in exporter.build_registry(r, client.keys).collect()}
    assert not families["kvgate_tenant_backlog"].samples  # no made-up zeros for what cannot be seen


def test_stats_cost_the_same_with_100000_backlogged_tenants_and_count_the_rest_as_other(redis_server, namespace):
    r, keys = redis_server.client(), Keys(namespace)
    r.set(keys.fair(), 1)
    with Client(redis_server.url, namespace, tenant="big") as client:
        client.submit_many([{"prompt": "x"}] * 5, progress=False)
    band = keys.jobs(None, "normal")

    def commands() -> int:
        return sum(v["calls"] for k, v in r.info("commandstats").items() if k != "cmdstat_info")

    def cost() -> tuple[int, object]:
        before = commands()
        got = read_queue_stats(r, keys)
        return commands() - before, got

    small, _ = cost()
    for start in range(0, 100_000, 20_000):  # 100,000 tenants backlogged, one job each, as their counter says
        r.zadd(Keys.fair_backlog(band), {f"t{i}": 1.0 + i for i in range(start, start + 20_000)})
    r.incrby(Keys.fair_queued(band), 100_000)
    large, got = cost()
    assert large <= small + 4 * 2 * TOP_TENANTS + 4, (small, large)  # the ends of the band's set, not all of it
    view = view_of(got)
    assert view["big"]["backlog"] == 5  # its counter is the lowest: served next, so named
    assert view[OTHER_TENANTS]["backlog"] == 100_000  # the rest: the band's counter minus what was named
    assert got.backlog == 100_005


def test_running_tokens_and_queue_wait_are_summed_over_workers_and_folded_to_the_busiest_ten(redis_server,
                                                                                             namespace):
    r, keys = redis_server.client(), Keys(namespace)
    beat(r, keys, "w1", {"a": row(2, 600, {0.01: 97, 5.0: 2}), "_other": row(1, 60)})
    beat(r, keys, "w2", {"a": row(1, 600, {5.0: 1}), **{f"t{i}": row(1 if i < 12 else 0, i) for i in range(20)}})
    beat(r, keys, "w3", "not json{")  # a heartbeat a reader cannot parse counts for nothing, and stops nothing
    got = read_queue_stats(r, keys)
    a = view_of(got)["a"]
    assert a["running"] == 3 and a["tokens"] == 1200 and a["tokens_per_s"] == 20.0
    assert 0.005 <= a["queue_wait_p50_s"] <= 0.01 and 1.0 <= a["queue_wait_p99_s"] <= 5.0
    assert len(got.tenant_view.top) == TOP_TENANTS and got.tenant_view.top[0].tenant == "a"
    named = {t.tenant for t in got.tenant_view.top}
    running_total = 3 + 1 + 12
    assert sum(t.running for t in got.tenant_view.top) + got.tenant_view.other.running == running_total
    assert got.tenant_view.other.running == running_total - 3 - 9 and "t19" not in named
    d = got.to_dict()["tenant_view"]
    assert d["other"]["tenant"] == OTHER_TENANTS and d["window_s"] == 60.0
    text = stats_command.render(got, namespace)
    assert "(other tenants)" in text and any(line.startswith("a ") for line in text.splitlines())
    samples = {(s.name, s.labels["tenant"]): s.value for f in exporter.build_registry(r, keys).collect()
               if f.name.startswith("kvgate_tenant") for s in f.samples}
    assert samples[("kvgate_tenant_running_jobs", "a")] == 3
    assert samples[("kvgate_tenant_tokens_per_second", "a")] == 20.0
    assert 1.0 <= samples[("kvgate_tenant_queue_wait_p99_seconds", "a")] <= 5.0
    tenants = {t for (name, t) in samples if name == "kvgate_tenant_running_jobs"}
    assert len(tenants) == TOP_TENANTS + 1 and OTHER_TENANTS in tenants  # bounded however many tenants
