"""Lease renewal must keep a worker's own entries, not take back one that another worker has legitimately
reclaimed (after a stall longer than the reclaim timeout): two owners in turn means both run the job, and each
later recovery of it counts one more delivery."""
from __future__ import annotations

import threading
import time

from tests.support import RawQueue, wait_for
from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.keys import Keys
from kvgate.worker.settings import WorkerSettings
from kvgate.worker.worker import Worker


def test_a_renewal_does_not_take_back_an_entry_another_worker_reclaimed(redis_server, namespace):
    engine = SimulatedEngine(num_blocks=256, max_num_seqs=4, step_overhead_s=0.02, per_token_s=0.0)
    settings = WorkerSettings(redis_url=redis_server.url, namespace=namespace, worker_id="owner",
                              reclaim_idle_ms=400)  # renew: 0.1 s
    worker = Worker(engine, settings)
    queue, stop = RawQueue(redis_server, namespace), threading.Event()
    stream = queue.keys.jobs(None, "normal")
    queue.r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)  # as the SDK does; XPENDING needs the group
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        queue.submit("a long job", max_tokens=200)  # about 4 s of steps
        owner = lambda: [r["consumer"] for r in queue.r.xpending_range(stream, Keys.GROUP, "-", "+", 10)]
        wait_for(lambda: owner() == [b"owner"], timeout=10, what="the owner to take the job")
        (entry,) = [r["message_id"] for r in queue.r.xpending_range(stream, Keys.GROUP, "-", "+", 10)]
        queue.r.xclaim(stream, Keys.GROUP, "thief", 0, [entry], justid=True)  # as XAUTOCLAIM after a stall
        assert owner() == [b"thief"]
        for _ in range(5):  # several renewals of the owner; the thief renews too, as a live worker does
            time.sleep(0.1)
            assert owner() == [b"thief"], "the owner's renewal took the entry back"
            queue.r.xclaim(stream, Keys.GROUP, "thief", 0, [entry], justid=True)
        assert not engine.has_unfinished(), "the owner kept running a job whose lease it lost"
    finally:
        stop.set()
        thread.join(20)
