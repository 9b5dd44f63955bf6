"""Deadline order in running workers (issue 44, worker/due.py): served earliest deadline first; a SIGKILLed worker's
jobs and the jobs parked beside them are each answered once; a worker with the setting off beside one with it on
loses nothing."""
from __future__ import annotations

import random
import signal
import time
from collections import Counter

import pytest

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import decode_job
from tests.support import wait_for

HOUR = 3600.0
SIM = ("--simulated", "--sim-num-blocks", "1024", "--sim-per-token-ms", "0.01")


def one_at_a_time() -> SimulatedEngine:
    return SimulatedEngine(num_blocks=512, block_size=16, max_num_seqs=1, step_overhead_s=0.002, per_token_s=0.0)


def held_by(queue, consumer: str) -> set[str]:
    stream = queue.keys.jobs(None, "normal")
    if not queue.r.exists(stream) or not queue.r.xinfo_groups(stream):
        return set()
    return {row["message_id"].decode() for row in queue.r.xpending_range(stream, Keys.GROUP, "-", "+", 1000, consumer)}


def submit_with_deadlines(queue, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [queue.submit(f"job {i}", max_tokens=20, deadline=None if rng.random() < 0.3 else
                         time.time() + rng.uniform(HOUR, 2 * HOUR)) for i in range(n)]


def assert_one_final_each(queue, ids: list[str]) -> None:
    counts = Counter(f.job_id for f in queue.finals())
    assert set(counts) == set(ids) and set(counts.values()) == {1}, counts


@pytest.mark.parametrize("redis", ["7", "6.2"])
def test_a_worker_serves_jobs_earliest_deadline_first(request, redis, thread_worker):
    q = request.getfixturevalue("queue" if redis == "7" else "queue62")
    late = q.submit("late", max_tokens=4, deadline=time.time() + 2 * HOUR)
    none = q.submit("none", max_tokens=4)
    early = q.submit("early", max_tokens=4, deadline=time.time() + HOUR)
    with thread_worker(one_at_a_time(), q=q):
        finals = q.wait_finals(3)
    assert [f.job_id for f in finals] == [none, early, late]  # none: due when it arrived, first
    assert all(f.attempt == 1 for f in finals) and q.parked() == 0 and q.pending() == 0


def test_a_high_job_goes_before_an_earlier_due_normal_one(queue, thread_worker):
    normal = queue.submit("normal", max_tokens=4, deadline=time.time() + 60)
    high = queue.submit("high", max_tokens=4, priority="high", deadline=time.time() + 5 * HOUR)
    with thread_worker(one_at_a_time()):
        finals = queue.wait_finals(2)
    assert [f.job_id for f in finals] == [high, normal]


def test_a_sigkilled_workers_jobs_and_the_parked_ones_are_each_answered_once(queue, spawn):
    a = spawn(queue.server.url, queue.ns, *SIM, "--max-num-seqs", "2", "--local-queue-size", "2", "--sim-step-ms",
              "20", "--deadline-window", "8", "--reclaim-idle-ms", "800", worker_id="a")
    ids = submit_with_deadlines(queue, 24, seed=1)
    wait_for(lambda: held_by(queue, "a") and queue.parked() == 8, 20, "worker a running jobs with 8 parked")
    a.send_signal(signal.SIGSTOP)
    time.sleep(0.3)  # what it sent before the stop has run
    running, parked = held_by(queue, "a"), held_by(queue, Keys.PARKED)
    assert len(parked) == 8 and running
    job_of = {e.decode(): decode_job(f[b"p"]).job_id for e, f in queue.r.xrange(queue.keys.jobs(None, "normal"))}
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "2", "--reclaim-idle-ms", "800", worker_id="b")
    queue.wait_finals(24, timeout=60)
    time.sleep(0.3)
    assert_one_final_each(queue, ids)
    attempts = {f.job_id: f.attempt for f in queue.finals()}
    assert {attempts[job_of[e]] for e in parked} == {1}  # a parked job was never taken for the dead worker's
    assert max(attempts.values()) <= 2
    assert queue.parked() == 0 and queue.pending() == 0


def test_a_worker_with_deadline_order_off_beside_one_with_it_on_loses_nothing(queue, thread_worker):
    small = dict(local_queue_size=2, deadline_window=4)
    with thread_worker(one_at_a_time(), worker_id="on", **small), \
            thread_worker(one_at_a_time(), worker_id="off", deadline_order="off", **small):
        ids = submit_with_deadlines(queue, 40, seed=2)
        queue.wait_finals(40, timeout=60)
        time.sleep(0.3)
    assert_one_final_each(queue, ids)
    assert {f.attempt for f in queue.finals()} == {1}
    assert queue.parked() == 0 and queue.pending() == 0
