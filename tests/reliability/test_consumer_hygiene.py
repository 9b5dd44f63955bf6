"""Workers that join and leave must not pile up consumers in the job streams' group (issue 14, item 8): 30 came
and went and left 31 consumers per stream for 1 live worker. A worker deletes its own consumer on a clean exit,
and a live worker's housekeeping deletes consumers idle past the reclaim timeout with nothing pending and no
live heartbeat; never one that still holds entries. Stats count live workers (heartbeats) only."""
from __future__ import annotations

import signal
import time

import redis

from tests.reliability.chaos_harness import Ledger, stop_all
from tests.support import RawQueue, spawn_worker, wait_for
from kvgate.producer.keys import Keys
from kvgate.producer.queue_stats import read_queue_stats
from kvgate.worker.consumers import Consumers

RECLAIM_MS = 1000
SIM = ("--simulated", "--sim-num-blocks", "2048", "--max-num-seqs", "2", "--sim-step-ms", "5",
       "--sim-per-token-ms", "0", "--reclaim-idle-ms", str(RECLAIM_MS))
ENV = {"OMP_NUM_THREADS": "1", "KVGATE_HEARTBEAT_TTL_S": "2"}  # the departing workers' heartbeats go quickly


def consumers(r: redis.Redis, keys: Keys) -> dict[str, set[str]]:
    out = {}
    for stream in keys.all_jobs(None):
        try:
            out[stream] = {c["name"].decode() for c in r.xinfo_consumers(stream, Keys.GROUP)}
        except redis.ResponseError:
            out[stream] = set()
    return out


def test_departed_workers_leave_no_consumers_behind_and_stats_count_live_workers(redis_server, namespace, tmp_path):
    r, keys = redis_server.client(), Keys(namespace)
    for stream in keys.all_jobs(None):
        r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    queue = RawQueue(redis_server, namespace)
    transient = [spawn_worker(redis_server.url, namespace, *SIM, worker_id=f"t{i}", log=tmp_path / f"t{i}.log", env=ENV)
                 for i in range(4)]
    live = None
    try:
        for i in range(4):
            wait_for(lambda: r.exists(keys.worker(f"t{i}")), timeout=60, what=f"worker t{i}'s heartbeat")
        jobs = [queue.submit("a short job", max_tokens=200, ignore_eos=True) for _ in range(8)]
        wait_for(lambda: Ledger(r, keys).pending() >= 4, timeout=10, what="the transient workers to take jobs")
        for proc in transient[:2]:  # crashes, possibly holding jobs: someone must reclaim them first
            proc.send_signal(signal.SIGKILL)
        for proc in transient[2:]:  # clean exits
            proc.send_signal(signal.SIGTERM)
        for proc in transient:
            proc.wait(30)
        assert all(p.returncode == 0 for p in transient[2:])
        live = spawn_worker(redis_server.url, namespace, *SIM, worker_id="live", log=tmp_path / "live.log",
                            env={"OMP_NUM_THREADS": "1"})  # the default heartbeat TTL: no blink under load
        ledger = Ledger(r, keys)
        wait_for(lambda: len(ledger.final_counts([queue.client_id])) == 8, timeout=30, what="every job answered")
        assert set(ledger.final_counts([queue.client_id]).values()) == {1} and set(jobs) == set(
            ledger.final_counts([queue.client_id]))
        wait_for(lambda: all(c <= {"live"} for c in consumers(r, keys).values()), timeout=15,
                 what=lambda: f"departed consumers to go: {consumers(r, keys)}")
        print(f"consumers per stream after 4 departures: {[len(c) for c in consumers(r, keys).values()]}")
        stats = read_queue_stats(r, keys)
        assert [w.worker_id for w in stats.workers] == ["live"]
        assert ledger.pending() == 0
    finally:
        stop_all([*transient, *([live] if live else [])])


def test_pruning_never_deletes_a_consumer_that_holds_entries_or_has_a_live_heartbeat(redis_server, namespace):
    r, keys = redis_server.client(), Keys(namespace)
    stream = keys.jobs(None, "normal")
    r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    entry = r.xadd(stream, {"job": b"x"})
    r.xreadgroup(Keys.GROUP, "holder", {stream: ">"}, count=1)  # crashed holding an entry: reclaim's, not ours
    for name in ("empty", "alive", "me"):
        r.xgroup_createconsumer(stream, Keys.GROUP, name)
    r.set(keys.worker("alive"), "heartbeat")
    time.sleep(0.15)
    pruned = Consumers(r, keys, "me", [stream], min_idle_ms=100).prune()
    assert pruned == ["empty"]
    assert {c["name"].decode() for c in r.xinfo_consumers(stream, Keys.GROUP)} == {"holder", "alive", "me"}
    assert [row["consumer"] for row in r.xpending_range(stream, Keys.GROUP, "-", "+", 10)] == [b"holder"]
    assert Consumers(r, keys, "holder", [stream], 100).retire() == [stream]  # holds an entry: kept
    assert Consumers(r, keys, "me", [stream], 100).retire() == []
    assert {c["name"].decode() for c in r.xinfo_consumers(stream, Keys.GROUP)} == {"holder", "alive"}
    assert r.xpending_range(stream, Keys.GROUP, "-", "+", 10)[0]["message_id"] == entry


def test_a_prune_pass_looks_at_a_bounded_slice_of_many_streams_and_in_turns_at_all_of_them(redis_server, namespace):
    """With LoRA adapters a worker reads three streams an adapter (600 for 200): a pass over all of them, on each
    worker every trim, held Redis 15 ms a worker, and a fleet started together stalled every five seconds (W-LORA's
    fleet). A pass now looks at PRUNE_STREAMS of them, the next pass on from there: each departed consumer still goes,
    within as many passes as the streams fill slices."""
    from kvgate.worker.consumers import PRUNE_STREAMS

    r, keys = redis_server.client(), Keys(namespace)
    streams = [keys.jobs(f"adapter-{k:03d}", "normal") for k in range(150)]
    for stream in streams:
        r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
        r.xgroup_createconsumer(stream, Keys.GROUP, "departed")
    time.sleep(0.15)
    pruner = Consumers(r, keys, "me", list(streams), min_idle_ms=100)

    def xinfo_calls() -> int:
        return sum(v["calls"] for k, v in r.info("commandstats").items() if k.startswith("cmdstat_xinfo"))

    passes = -(-len(streams) // PRUNE_STREAMS)
    for _ in range(passes):
        before = xinfo_calls()
        assert pruner.prune() == ["departed"]
        assert xinfo_calls() - before == PRUNE_STREAMS  # one XINFO CONSUMERS a stream of the slice
    assert [s for s in streams if r.xinfo_consumers(s, Keys.GROUP)] == []  # every stream's departed one went
