"""The heartbeat reports the capacity the engine was built with, never the worker setting that asked for it; workers
are listed from the registry their beats keep, never by scanning the keyspace."""
from __future__ import annotations

import pytest

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.keys import Keys
from kvgate.producer.queue_stats import read_queue_stats
from kvgate.worker.heartbeat import engine_capacity
from kvgate.worker.settings import WorkerSettings
from kvgate.worker.worker import Worker
from tests.support import wait_for


def beating(redis_server, engine, worker_id: str = "w-cap", namespace: str = "cap", ttl_s: int = 30) -> Worker:
    settings = WorkerSettings(redis_url=redis_server.url, namespace=namespace, worker_id=worker_id, max_num_seqs=32,
                              sim_num_blocks=64, heartbeat_ttl_s=ttl_s)
    worker = Worker(engine, settings)
    worker._beat()
    return worker


def beat_of(redis_server, engine) -> dict[bytes, bytes]:
    beating(redis_server, engine)
    return redis_server.client().hgetall(Keys("cap").worker("w-cap"))


def test_heartbeat_carries_the_real_engines_max_num_seqs_and_blocks_not_the_settings(redis_server):
    from kvgate.engine import LLMEngine
    from tests.engine.helpers import BLOCK_BYTES, tiny_source

    # built differently from what the settings say (32 sequences, 64 blocks)
    engine = LLMEngine(tiny_source("llama", seed=3)[0], max_num_seqs=3, kv_cache_memory=10 * BLOCK_BYTES,
                       max_model_len=64)
    beat = beat_of(redis_server, engine)
    assert beat[b"max_num_seqs"] == b"3" and beat[b"total_blocks"] == b"10"


def test_heartbeat_carries_the_simulated_engines_capacity(redis_server):
    beat = beat_of(redis_server, SimulatedEngine(100, 16, 7, 0.0, 0.0, 0))
    assert beat[b"max_num_seqs"] == b"7" and beat[b"total_blocks"] == b"100"


def test_an_engine_without_a_capacity_is_refused_rather_than_guessed():
    with pytest.raises(AttributeError):
        engine_capacity(object())


def sim() -> SimulatedEngine:
    return SimulatedEngine(100, 16, 7, 0.0, 0.0, 0)


def scans(r) -> int:
    return int(r.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))


def test_stats_list_workers_from_the_registry_without_scanning_the_keyspace(redis_server):
    r, keys = redis_server.client(), Keys("reg")
    r.mset({f"reg:result:{i}": "x" for i in range(2_000)})  # what SCAN would have walked
    for name in ("w-a", "w-b"):
        beating(redis_server, sim(), name, "reg")
    before = scans(r)
    stats = read_queue_stats(r, keys)
    assert sorted(w.worker_id for w in stats.workers) == ["w-a", "w-b"]
    assert scans(r) == before  # SCAN's cost grows with every key in the database, not with the workers


def test_a_dead_workers_registry_entry_is_dropped_by_the_next_beat_and_a_stopped_one_leaves_at_once(redis_server):
    r, keys = redis_server.client(), Keys("reg2")
    beating(redis_server, sim(), "gone", "reg2", ttl_s=1)
    alive = beating(redis_server, sim(), "alive", "reg2")
    assert {m.decode() for m in r.zrange(keys.workers(), 0, -1)} == {"gone", "alive"}
    wait_for(lambda: not r.exists(keys.worker("gone")), 5, "the 1 s heartbeat to expire")
    assert [w.worker_id for w in read_queue_stats(r, keys).workers] == ["alive"]  # expired: not listed
    alive._beat()
    assert [m.decode() for m in r.zrange(keys.workers(), 0, -1)] == ["alive"]  # and pruned, on the server's clock
    alive.heartbeat.stop()
    assert r.zcard(keys.workers()) == 0 and not r.exists(keys.worker("alive"))
