"""A job a small worker read but cannot fit goes back to Redis for another worker's next read (worker/hand_back.py),
with no delivery counted, and a lone small worker still serves it once it has room (issue 45)."""
from __future__ import annotations

import shutil

import pytest
import redis

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD
from kvgate.worker.admission import Ticket
from kvgate.worker.hand_back import HandBack
from kvgate.worker.reader import Reader, ReadPlan
from tests.support import fair_enqueue, redis_major, wait_for


def small_engine(step_s: float = 0.02) -> SimulatedEngine:
    """128 tokens of KV cache: a long job of 98 tokens leaves no room for a 108-token one beside it."""
    return SimulatedEngine(num_blocks=8, block_size=16, max_num_seqs=4, step_overhead_s=step_s, per_token_s=0.0)


def start_long_then_big(queue, engine: SimulatedEngine) -> tuple[str, str]:
    """A long job running on the small worker, then a big one it reads (its estimate says a job fits) but cannot
    fit beside the long one: both pending to it."""
    long_id = queue.submit(prompt_token_ids=[1] * 8, max_tokens=90)
    wait_for(engine.has_unfinished, 10, "the small worker running the long job", every=0.005)
    big_id = queue.submit(prompt_token_ids=[2] * 100, max_tokens=8)
    wait_for(lambda: queue.pending() == 2, 10, "the small worker reading the big job", every=0.005)
    return long_id, big_id


def test_a_job_the_small_worker_cannot_fit_is_finished_by_a_big_worker_while_its_long_job_runs(queue, thread_worker):
    engine = small_engine(step_s=0.2)  # the long job runs 18 s unless cancelled: far longer than the hand-back
    with thread_worker(engine, worker_id="small", initial_tokens_per_job=16):
        long_id, big_id = start_long_then_big(queue, engine)
        with thread_worker(worker_id="big"):
            first = queue.wait_finals(1)[0]
            assert first.job_id == big_id, f"the {'long' if first.job_id == long_id else 'other'} job finished first"
            assert first.worker == "big" and first.attempt == 1  # the hand-back counted no delivery
            assert engine.has_unfinished()  # the small worker still runs the long job
            queue.cancel(long_id)  # its end is not this test's
            finals = queue.wait_finals(2)
    assert sorted(f.job_id for f in finals) == sorted([long_id, big_id]) and len(queue.finals()) == 2
    assert [(f.worker, f.status) for f in finals if f.job_id == long_id] == [("small", "cancelled")]
    assert queue.r.zcard(queue.keys.handed_back()) == 0 and queue.pending() == 0


def test_a_lone_small_worker_serves_the_job_it_handed_back_once_it_has_room(queue, thread_worker):
    engine = small_engine()
    with thread_worker(engine, worker_id="small", initial_tokens_per_job=16):
        long_id, big_id = start_long_then_big(queue, engine)
        wait_for(lambda: queue.r.zcard(queue.keys.handed_back()) == 1, 10, "the big job handed back", every=0.005)
        finals = queue.wait_finals(2)
        assert len(queue.finals()) == 2  # one final per job, nothing more
    assert [f.job_id for f in finals] == [long_id, big_id]  # the big one waited for room, then ran here
    assert all(f.worker == "small" and f.attempt == 1 for f in finals)
    assert queue.r.zcard(queue.keys.handed_back()) == 0 and queue.pending() == 0


@pytest.mark.skipif(redis_major(shutil.which("redis-server")) < 7, reason="ACL selectors need redis-server >= 7")
def test_only_workers_may_list_a_job_as_handed_back(acl_server):
    """A listed entry moves to whichever worker reads next: a producer able to list one could take a running job
    away from its worker (deploy/redis/acl.conf)."""
    index = Keys("kvgate").handed_back()
    acl_server("worker").zadd(index, {"w1\n1-0\nkvgate:jobs:default:normal": 1})
    with pytest.raises(redis.exceptions.NoPermissionError):
        acl_server("producer").zadd(index, {"w1\n2-0\nkvgate:jobs:default:normal": 1})


def test_under_fair_share_a_tenants_job_the_small_worker_cannot_fit_is_taken_from_its_tenants_stream(queue,
                                                                                                    thread_worker):
    """W-FAIR's case: both jobs one tenant's, so the big one cannot make room on the small worker (its tenant is at
    its share there); it goes back from the tenant's stream and the big worker takes it there, with no delivery
    counted."""
    queue.r.set(queue.keys.fair(), 1)
    band = queue.keys.jobs(None, "normal")
    stream = Keys.tenant_jobs(band, "a")
    engine = small_engine(step_s=0.05)

    def put(ids: list[int], max_tokens: int) -> str:
        return fair_enqueue(queue.r, band, [queue.job(prompt_token_ids=ids, max_tokens=max_tokens, tenant="a")])[0]

    with thread_worker(engine, worker_id="small", initial_tokens_per_job=16):
        long_id = put([1] * 8, 90)
        wait_for(engine.has_unfinished, 10, "the small worker running the long job", every=0.005)
        big_id = put([2] * 100, 8)
        wait_for(lambda: queue.r.xpending(stream, Keys.GROUP)["pending"] == 2, 10, "the small worker reading it",
                 every=0.005)
        with thread_worker(worker_id="big"):
            first = queue.wait_finals(1)[0]
            assert first.job_id == big_id, f"the {'long' if first.job_id == long_id else 'other'} job finished first"
            assert first.worker == "big" and first.attempt == 1
            assert engine.has_unfinished()
            queue.cancel(long_id)
            queue.wait_finals(2)
    assert len(queue.finals()) == 2 and queue.r.xpending(stream, Keys.GROUP)["pending"] == 0


def test_a_read_takes_a_handed_back_entry_before_new_ones_and_its_giver_only_after_the_grace(queue):
    stream = queue.keys.jobs(None, "normal")
    queue.r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    first, second, third = (queue.xadd(f"job {i}".encode()) for i in range(3))

    def reader(worker: str, grace_ms: int) -> Reader:
        return Reader(queue.r, worker, ReadPlan([stream]), keys=queue.keys, handed_grace_ms=grace_ms)

    def give(worker: str, entry_id: str) -> None:
        HandBack(queue.r, queue.keys, worker, 100).give([Ticket(None, stream, entry_id, [], None, b"")])

    assert [e.entry_id for e in reader("w1", 60_000).read(1)] == [first]
    give("w1", first)
    assert [(e.entry_id, e.handed_back) for e in reader("w1", 60_000).read(1)] == [(second, False)]  # in its grace
    [taken] = reader("w2", 60_000).read(1)
    assert (taken.entry_id, taken.deliveries, taken.handed_back, taken.fields) == (first, 1, True, {FIELD.encode(): b"job 0"})
    assert queue.r.xpending_range(stream, Keys.GROUP, first, first, 1)[0]["consumer"] == b"w2"
    give("w2", first)
    [back] = reader("w2", 0).read(1)  # its giver, once its grace (none here) has passed; before the new third
    assert (back.entry_id, back.deliveries, back.handed_back) == (first, 1, True)
    assert queue.r.xpending_range(stream, Keys.GROUP, first, first, 1)[0]["times_delivered"] == 1
    assert queue.r.zcard(queue.keys.handed_back()) == 0
    assert [e.entry_id for e in reader("w3", 0).read(2)] == [third]
