"""Deadline order in affinity lanes (issue 44, worker/due.py): a lane is read earliest deadline first as a shared
stream is; a thief counts a lane's parked entries by their arrival, so a busy, stalled or killed owner's parked jobs
are still stolen once ripe or overdue; a reclaim leaves them alone; a reader with the setting off takes them first;
stats and a job's status count them as waiting. Reads with the Reader on Redis 7 and 6.2, then real workers."""
from __future__ import annotations

import signal
import time
from collections import Counter

import pytest

from kvgate import Client
from kvgate.producer.keys import DEFAULT_MODEL, Keys
from kvgate.producer.lanes import lane_of, owners, routing_key
from kvgate.producer.protocol import FIELD, decode_job, due_fields, encode
from kvgate.producer.submission import stream_for
from kvgate.worker.reader import Reader, ReadPlan
from tests.support import wait_for
from tests.worker.test_affinity import AFFINITY, LANES, SIM, settled_ring
from tests.worker.test_deadline_fleet import one_at_a_time

HOUR = 3600.0


@pytest.fixture(params=["7", "6.2"])
def q(request):
    return request.getfixturevalue("queue" if request.param == "7" else "queue62")


def lanes_of(q, *lanes: int) -> list[str]:
    """Lane streams of the default model's normal priority, each with the workers' group."""
    streams = [q.keys.jobs(None, "normal", lane) for lane in lanes]
    for stream in streams:
        q.r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    return streams


def submit_to(q, stream: str, name: str, ttl_s: float | None) -> str:
    """A job in a lane with its deadline's field as the SDK writes it; its entry id."""
    job = q.job(job_id=name, max_tokens=2, deadline=None if ttl_s is None else time.time() + ttl_s)
    return q.r.xadd(stream, {FIELD: encode(job), **due_fields(job)}).decode()


def names(entries) -> list[str]:
    return [decode_job(e.fields[b"p"]).job_id for e in entries]


def parked(q, stream: str) -> int:
    return q.r.zcard(q.keys.due_index(stream))


def park(q, stream: str, window: int = 8) -> list[str]:
    """An owner's read of one job of the lane, which parks the rest of its window (as the shared streams' reads do);
    the job it took."""
    return names(Reader(q.r, "owner", ReadPlan([stream]), keys=q.keys, deadline_window=window).read(1))


def test_an_owner_reads_its_lane_earliest_deadline_first(q):
    (own,) = lanes_of(q, 0)
    for name, ttl in (("late", 3 * HOUR), ("mid", 2 * HOUR), ("none", None), ("early", HOUR)):
        submit_to(q, own, name, ttl)
    owner = Reader(q.r, "owner", ReadPlan([own], home=1), keys=q.keys, deadline_window=8)
    got = [e for _ in range(4) for e in owner.read(1)]
    assert names(got) == ["none", "early", "mid", "late"]  # none: due when it arrived
    assert {e.deliveries for e in got} == {1} and parked(q, own) == 0


def test_a_thief_takes_parked_lane_entries_once_they_arrived_a_steal_age_ago_earliest_due_first(q):
    own, theirs = lanes_of(q, 0, 1)
    for name, ttl in (("late", 3 * HOUR), ("mid", 2 * HOUR), ("early", HOUR), ("first", 30.0)):
        submit_to(q, theirs, name, ttl)
    assert park(q, theirs) == ["first"] and parked(q, theirs) == 3  # the owner took one and parked the rest
    thief = Reader(q.r, "thief", ReadPlan([own, theirs], home=1), keys=q.keys, steal_age_ms=400, deadline_window=8)
    assert thief.read(4) == []  # the owner's chance
    time.sleep(0.45)
    got = thief.read(4)  # one steal per read (steal_max)
    assert [(e.stream, e.deliveries) for e in got] == [(theirs, 1)] and names(got) == ["early"]
    assert names(thief.read(4)) == ["mid"] and parked(q, theirs) == 1


def test_a_thief_takes_an_overdue_parked_lane_entry_before_its_own(q):
    own, theirs = lanes_of(q, 0, 1)
    for name, ttl in (("late", 2 * HOUR), ("early", HOUR), ("first", 30.0)):
        submit_to(q, theirs, name, ttl)
    park(q, theirs)
    time.sleep(0.35)
    submit_to(q, own, "mine", None)
    plan = ReadPlan([own], home=1, overdue=[theirs], overdue_ms=300)
    thief = Reader(q.r, "thief", plan, keys=q.keys, steal_age_ms=10_000, deadline_window=8)
    assert names(thief.read(1)) == ["early"]  # overdue: before our own, earliest due first
    assert names(thief.read(1)) == ["late"] and names(thief.read(1)) == ["mine"]


def test_a_reclaim_of_lanes_leaves_parked_entries_alone_but_takes_a_dead_owners(q):
    own, theirs = lanes_of(q, 0, 1)
    for name, ttl in (("a", HOUR), ("b", 2 * HOUR), ("c", 3 * HOUR)):
        submit_to(q, theirs, name, ttl)
    assert park(q, theirs) == ["a"]
    for consumer in ("owner", Keys.PARKED):  # every entry idle long past the reclaim timeout
        ids = [row["message_id"] for row in q.r.xpending_range(theirs, Keys.GROUP, "-", "+", 10, consumer)]
        q.r.xclaim(theirs, Keys.GROUP, consumer, 0, ids, idle=10**7, justid=True)
    thief = Reader(q.r, "thief", ReadPlan([own, theirs], home=1), keys=q.keys, steal_age_ms=10**7, deadline_window=8)
    got = thief.read(3, reclaim_idle_ms=1000)
    assert [(names([e])[0], e.deliveries) for e in got] == [("a", 2)]  # the dead owner's, counted again
    assert parked(q, theirs) == 2  # not taken for a dead worker's


def test_a_lane_reader_with_deadline_order_off_takes_parked_entries_first_in_their_order(q):
    (lane,) = lanes_of(q, 0)
    for name, ttl in (("late", 2 * HOUR), ("first", 30.0), ("a", 3 * HOUR), ("early", HOUR)):
        submit_to(q, lane, name, ttl)
    assert park(q, lane) == ["first"]
    submit_to(q, lane, "new", None)
    off = Reader(q.r, "off", ReadPlan([lane], home=1), keys=q.keys, deadline_window=0)
    assert names(off.read(5)) == ["early", "late", "a", "new"] and parked(q, lane) == 0


def test_stats_and_a_jobs_status_count_parked_lane_jobs_as_waiting(queue):
    from kvgate.producer.queue_stats import read_queue_stats

    queue.r.set(queue.keys.lanes(), LANES)
    (lane,) = lanes_of(queue, lane_of(routing_key(prefix_key="s-1"), LANES))  # a worker made its group
    with Client(queue.server.url, queue.ns) as client:
        handles = [client.submit("p", prefix_key="s-1", max_tokens=2, ttl_s=ttl) for ttl in (3 * HOUR, 2 * HOUR, HOUR)]
        assert park(queue, lane) == [handles[2].job_id] and parked(queue, lane) == 2
        stats = read_queue_stats(queue.r, queue.keys).priorities["normal"]
        assert (stats.backlog, stats.pending) == (2, 1)
        assert [h.status().state for h in handles] == ["queued", "queued", "running"]


# ---- real workers ----------------------------------------------------------------------------------------------

def submit_keyed(queue, key: str, ttl_s: float | None, lanes: int = LANES, **sampling) -> str:
    """A job routed and written as the SDK does (its prefix_key's lane, its deadline's field); its id."""
    job = queue.job("p", deadline=None if ttl_s is None else time.time() + ttl_s, **sampling)
    queue.r.xadd(stream_for(job, DEFAULT_MODEL, queue.keys, lanes, key), {FIELD: encode(job), **due_fields(job)})
    return job.job_id


def test_a_worker_with_affinity_serves_one_lanes_jobs_earliest_deadline_first(queue, thread_worker):
    queue.r.set(queue.keys.lanes(), LANES)
    late, mid, none, early = (submit_keyed(queue, "s-1", ttl, max_tokens=4) for ttl in (3 * HOUR, 2 * HOUR, None, HOUR))
    lane = queue.keys.jobs(None, "normal", lane_of(routing_key(prefix_key="s-1"), LANES))
    assert queue.r.xlen(lane) == 4  # routed into one lane
    with thread_worker(one_at_a_time(), affinity="on", affinity_lanes=LANES, heartbeat_interval_s=0.2):
        finals = queue.wait_finals(4)
    assert [f.job_id for f in finals] == [none, early, mid, late]
    assert {f.attempt for f in finals} == {1} and parked(queue, lane) == 0


def test_a_thief_serves_a_stalled_owners_parked_lane_jobs_earliest_deadline_first(queue, thread_worker):
    """The lane's owner (in the ring for the whole test: the thief's reclaim timeout, and so the owner's lapse, is a
    minute) read one job and parked the rest, then stopped: the thief must take them as the owner's queued jobs,
    once ripe, and not as a dead worker's (no second delivery)."""
    from kvgate.worker.affinity import Affinity, kv_weight

    engine = one_at_a_time()
    weight = kv_weight(engine.stats.total_blocks)
    ghost = Affinity(queue.r, queue.keys, "ghost", True, LANES, 120_000, weight=weight)
    ghost.sync()  # beats once, then never again
    lane = next(n for n, w in enumerate(owners({"ghost": weight, "thief": weight}, LANES)) if w == "ghost")
    key = next(k for k in (f"s-{i}" for i in range(1000)) if lane_of(routing_key(prefix_key=k), LANES) == lane)
    (stream,) = lanes_of(queue, lane)  # its group made, as the owner did
    ids = {ttl: submit_keyed(queue, key, ttl, max_tokens=4) for ttl in (6 * HOUR, 5 * HOUR, 4 * HOUR, 3 * HOUR,
                                                                         2 * HOUR, 60.0)}
    ghost_read = Reader(queue.r, "ghost", ReadPlan([stream]), keys=queue.keys, deadline_window=8)
    assert names(ghost_read.read(1)) == [ids[60.0]]  # the owner took one and parked the rest, then stalled
    assert parked(queue, stream) == 5
    with thread_worker(engine, worker_id="thief", affinity="on", affinity_lanes=LANES, heartbeat_interval_s=0.2,
                       heartbeat_ttl_s=120, reclaim_idle_ms=60_000) as tw:
        wait_for(lambda: tw.worker.affinity.owner(DEFAULT_MODEL, lane) == "ghost", 10, "the ghost owning the lane")
        finals = queue.wait_finals(5, timeout=30)
        assert tw.worker.affinity.owner(DEFAULT_MODEL, lane) == "ghost"  # taken by a thief, not by a new owner
    assert [f.job_id for f in finals] == [ids[ttl] for ttl in (2 * HOUR, 3 * HOUR, 4 * HOUR, 5 * HOUR, 6 * HOUR)]
    assert {(f.worker, f.attempt) for f in finals} == {("thief", 1)} and parked(queue, stream) == 0


def test_a_sigkilled_lane_owners_jobs_and_the_ones_parked_in_its_lane_are_each_answered_once(queue, spawn):
    a = spawn(queue.server.url, queue.ns, *SIM, *AFFINITY, "--max-num-seqs", "2", "--local-queue-size", "2",
              "--sim-step-ms", "20", "--deadline-window", "8", "--reclaim-idle-ms", "800", worker_id="a")
    settled_ring(queue, 1)
    stream = queue.keys.jobs(None, "normal", lane_of(routing_key(prefix_key="s-1"), LANES))
    ids = [submit_keyed(queue, "s-1", None if i % 3 == 0 else HOUR + (i * 7919) % 3600, max_tokens=20)
           for i in range(24)]

    def held_by(consumer: str) -> set[str]:
        return {row["message_id"].decode() for row in queue.r.xpending_range(stream, Keys.GROUP, "-", "+", 100,
                                                                            consumer)}

    wait_for(lambda: held_by("a") and parked(queue, stream) == 8, 20, "the owner running jobs with 8 parked")
    a.send_signal(signal.SIGSTOP)
    time.sleep(0.3)  # what it sent before the stop has run
    running, parked_ids = held_by("a"), held_by(Keys.PARKED)
    assert len(parked_ids) == 8 and running
    job_of = {e.decode(): decode_job(f[b"p"]).job_id for e, f in queue.r.xrange(stream)}
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    spawn(queue.server.url, queue.ns, *SIM, *AFFINITY, "--sim-step-ms", "2", "--reclaim-idle-ms", "800", worker_id="b")
    queue.wait_finals(24, timeout=60)
    time.sleep(0.3)
    counts = Counter(f.job_id for f in queue.finals())
    assert set(counts) == set(ids) and set(counts.values()) == {1}, counts
    attempts = {f.job_id: f.attempt for f in queue.finals()}
    assert {attempts[job_of[e]] for e in parked_ids} == {1}  # a parked job was never taken for the dead owner's
    assert max(attempts.values()) <= 2
    assert parked(queue, stream) == 0 and not queue.r.xpending(stream, Keys.GROUP)["pending"]


def test_lane_workers_with_deadline_order_off_beside_ones_with_it_on_lose_nothing(queue, thread_worker):
    queue.r.set(queue.keys.lanes(), 4)
    small = dict(local_queue_size=2, deadline_window=4, affinity="on", affinity_lanes=4, heartbeat_interval_s=0.2)
    with thread_worker(one_at_a_time(), worker_id="on", **small), \
            thread_worker(one_at_a_time(), worker_id="off", deadline_order="off", **small):
        ids = [submit_keyed(queue, f"s-{i % 3}", None if i % 4 == 0 else HOUR + (i * 7919) % 3600, lanes=4,
                            max_tokens=20) for i in range(40)]
        queue.wait_finals(40, timeout=60)
        time.sleep(0.3)
    counts = Counter(f.job_id for f in queue.finals())
    assert set(counts) == set(ids) and set(counts.values()) == {1}, counts
    assert {f.attempt for f in queue.finals()} == {1}
    for stream in queue.keys.job_streams(None, "normal", 4):
        assert parked(queue, stream) == 0
        assert not queue.r.exists(stream) or not queue.r.xpending(stream, Keys.GROUP)["pending"]
