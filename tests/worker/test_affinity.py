"""Prefix-affinity lanes with real workers: a key's jobs go to its lane's owner while it has room, an idle worker
steals from a saturated owner, a leaving worker's lanes pass to the others, and no transition strands a job."""
from __future__ import annotations

import os
import signal
import time

import pytest

from kvgate import Client
from kvgate.producer.lanes import decode_members, lane_of, owners, routing_key
from kvgate.producer.keys import DEFAULT_MODEL
from kvgate.producer.protocol import FIELD, encode
from kvgate.producer.submission import stream_for
from tests.support import wait_for

LANES = 8
BEAT = ("--heartbeat-interval-s", "0.2", "--heartbeat-ttl-s", "2")
SIM = ("--simulated", "--sim-num-blocks", "1024", "--sim-per-token-ms", "0.01", *BEAT)
AFFINITY = ("--affinity", "on", "--affinity-lanes", str(LANES))


def ring(queue) -> dict[str, float]:
    return decode_members(queue.r.zrange(queue.keys.lane_ring(None), 0, -1))


def settled_ring(queue, n: int) -> dict[str, float]:
    wait_for(lambda: len(ring(queue)) == n, 30, f"{n} workers in the lane ring")
    time.sleep(0.6)  # a few beats: every worker has recomputed its lanes from the full ring
    return ring(queue)


def owner_of(queue, key: str) -> str:
    return owners(ring(queue), LANES)[lane_of(routing_key(prefix_key=key), LANES)]


def submit_keyed(queue, key: str, n: int, lanes: int = LANES, **sampling) -> list[str]:
    """Jobs routed as the SDK routes them (their prefix_key's lane)."""
    ids = []
    for _ in range(n):
        job = queue.job("same system prompt", **sampling)
        queue.r.xadd(stream_for(job, DEFAULT_MODEL, queue.keys, lanes, key), {FIELD: encode(job)})
        ids.append(job.job_id)
    return ids


def key_owned_by(queue, worker: str) -> str:
    return next(k for k in (f"session-{i}" for i in range(1000)) if owner_of(queue, k) == worker)


def test_jobs_with_one_key_go_to_the_lane_owner_while_it_has_room(queue, spawn):
    for name in ("a", "b"):
        spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "2", *AFFINITY, worker_id=name)
    settled_ring(queue, 2)
    assert queue.r.get(queue.keys.lanes()) == str(LANES).encode()
    with Client(queue.server.url, queue.ns) as client:
        for key in ("session-1", "session-2", "session-3"):
            handles = [client.submit("hi", prefix_key=key, max_tokens=4, temperature=0) for _ in range(3)]
            workers = {h.result(timeout=30).worker for h in handles}
            assert workers == {owner_of(queue, key)}, key


def test_an_idle_worker_steals_from_a_saturated_owner(queue, spawn):
    slow = ("--sim-step-ms", "40", "--max-num-seqs", "1", "--local-queue-size", "2")
    for name in ("a", "b"):
        spawn(queue.server.url, queue.ns, *SIM, *slow, *AFFINITY, worker_id=name)
    settled_ring(queue, 2)
    key = key_owned_by(queue, "a")
    ids = submit_keyed(queue, key, 8, max_tokens=15, ignore_eos=True)
    finals = queue.wait_finals(8, timeout=60)
    assert sorted(f.job_id for f in finals) == sorted(ids)  # each answered once
    by = {w: sum(f.worker == w for f in finals) for w in ("a", "b")}
    assert by["a"] >= 1 and by["b"] >= 1, by  # the owner served its share, the idle one took the overflow


def test_a_killed_workers_lanes_pass_to_the_survivor_and_nothing_is_stranded(queue, spawn):
    reclaim = ("--reclaim-idle-ms", "800")
    a = spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "30", *reclaim, *AFFINITY, worker_id="a")
    spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "2", *reclaim, *AFFINITY, worker_id="b")
    settled_ring(queue, 2)
    key = key_owned_by(queue, "a")
    ids = submit_keyed(queue, key, 4, max_tokens=60, ignore_eos=True)
    wait_for(lambda: queue.r.xpending(queue.keys.jobs(None, "normal", lane_of(routing_key(prefix_key=key), LANES)),
                                      "workers")["pending"] >= 1, 20, "the owner holds jobs")
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    assert settled_ring(queue, 1).keys() == {"b"}  # a's beat in the ring expired: b owns every lane
    assert owner_of(queue, key) == "b"
    later = submit_keyed(queue, key, 3, max_tokens=4)
    finals = queue.wait_finals(7, timeout=60)
    assert sorted(f.job_id for f in finals) == sorted(ids + later)
    assert {f.worker for f in finals} == {"b"}  # a was killed before it finished any


def test_a_draining_worker_leaves_the_ring_at_once(queue, spawn):
    a = spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "2", *AFFINITY, "--heartbeat-ttl-s", "60",
              worker_id="a")
    spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "2", *AFFINITY, "--heartbeat-ttl-s", "60", worker_id="b")
    settled_ring(queue, 2)
    a.send_signal(signal.SIGTERM)
    assert a.wait(30) == 0
    assert ring(queue).keys() == {"b"}  # not after its 60 s beat expires


# ---- transitions: lanes switched on or off while jobs wait -------------------------------------------------------

def test_jobs_left_in_the_shared_stream_are_served_after_lanes_turn_on(queue, thread_worker):
    ids = [queue.submit(max_tokens=3) for _ in range(4)]  # a producer that never saw a lane count
    with thread_worker(affinity="on", affinity_lanes=4, heartbeat_interval_s=0.2):
        finals = queue.wait_finals(4)
    assert queue.r.get(queue.keys.lanes()) == b"4"
    assert sorted(f.job_id for f in finals) == sorted(ids)


def test_a_worker_with_affinity_off_still_reads_every_lane_the_namespace_has(queue, thread_worker):
    queue.r.set(queue.keys.lanes(), 4)  # lanes were on; jobs wait in them; the fleet restarts with affinity off
    ids = []
    for lane in range(4):
        job = queue.job(max_tokens=3)
        queue.r.xadd(queue.keys.jobs(None, "normal", lane), {FIELD: encode(job)})
        ids.append(job.job_id)
    with thread_worker(affinity="off", heartbeat_interval_s=0.2) as tw:
        finals = queue.wait_finals(4)
        assert tw.worker.affinity.owned_count == 0 and not queue.r.keys(queue.keys.lane_ring("*"))
    assert sorted(f.job_id for f in finals) == sorted(ids)


def test_the_lane_count_is_set_once_and_later_workers_follow_it(queue, thread_worker):
    with thread_worker(affinity="on", affinity_lanes=4, heartbeat_interval_s=0.2):
        wait_for(lambda: queue.r.get(queue.keys.lanes()) == b"4", 10, "lane count")
        with thread_worker(affinity="on", affinity_lanes=16, heartbeat_interval_s=0.2, worker_id="late") as late:
            wait_for(lambda: late.worker.affinity.lanes == 4, 10, "the late worker to adopt the namespace's count")
            assert len(late.worker.streams) == len(late.worker.served.names) * 3 * (4 + 1)
    assert queue.r.get(queue.keys.lanes()) == b"4"


def test_affinity_off_in_a_namespace_without_lanes_is_todays_layout(queue, thread_worker):
    with thread_worker() as tw:
        ids = [queue.submit(max_tokens=3) for _ in range(3)]
        finals = queue.wait_finals(3)
        names = list(tw.worker.served.names)
        assert tw.worker.streams == queue.keys.served_jobs(names) == [queue.keys.jobs(m, p) for p in ("high", "normal", "low")
                                                                         for m in names]
    assert sorted(f.job_id for f in finals) == sorted(ids)
    assert not queue.r.exists(queue.keys.lanes()) and not queue.r.keys(queue.keys.lane_ring("*"))


@pytest.mark.parametrize("lanes", [0, 4])
def test_stats_count_the_backlog_of_every_lane(queue, lanes):
    from kvgate.producer.queue_stats import read_queue_stats, total_backlog

    if lanes:
        queue.r.set(queue.keys.lanes(), lanes)
    queue.r.sadd(queue.keys.models(), "org/m")
    for model, key in (("default", "x"), ("default", "y"), ("org/m", "z"), ("org/m", "w")):
        job = queue.job("p", max_tokens=2, model=model)
        queue.r.xadd(stream_for(job, model, queue.keys, lanes, key), {FIELD: encode(job)})
    assert total_backlog(queue.r, queue.keys) == 4
    stats = read_queue_stats(queue.r, queue.keys)
    assert stats.priorities["normal"].backlog == 4
    assert {m: s.priorities["normal"].backlog for m, s in stats.models.items()} == {"default": 2, "org/m": 2}


@pytest.mark.parametrize("which", ["queue", "queue62"])
def test_a_new_job_in_another_workers_lane_is_taken_only_once_it_is_older_than_the_steal_age(which, request):
    from kvgate.worker.reader import Reader, ReadPlan

    q = request.getfixturevalue(which)
    own, theirs = q.keys.jobs(None, "normal", 0), q.keys.jobs(None, "normal", 1)
    for stream in (own, theirs):
        q.r.xgroup_create(stream, "workers", id="0", mkstream=True)
    reader = Reader(q.r, "thief", ReadPlan([own, theirs], home=1), steal_age_ms=400)
    job = q.job(max_tokens=2)
    q.r.xadd(theirs, {FIELD: encode(job)})
    assert reader.read(4) == []  # the owner's chance
    time.sleep(0.45)
    q.r.xadd(theirs, {FIELD: encode(q.job(max_tokens=2))})  # a younger one behind it stays
    assert [(e.stream, e.deliveries) for e in reader.read(4)] == [(theirs, 1)]
    q.r.xadd(own, {FIELD: encode(q.job(max_tokens=2))})
    assert [st for st, *_ in reader.read(4)] == [own]  # our own lane: no wait


def test_a_job_in_the_lane_of_an_owner_that_said_it_is_full_is_taken_at_once(queue):
    from kvgate.worker.reader import Reader, ReadPlan

    own, full, busy = (queue.keys.jobs(None, "normal", lane) for lane in range(3))
    for stream in (own, full, busy):
        queue.r.xgroup_create(stream, "workers", id="0", mkstream=True)
    reader = Reader(queue.r, "thief", ReadPlan([own, full, busy], home=1, urgent=1), steal_age_ms=10_000)
    for stream in (busy, full):
        queue.r.xadd(stream, {FIELD: encode(queue.job(max_tokens=2))})
    assert [st for st, *_ in reader.read(4)] == [full]  # the other owner still gets its 10 s head start
    assert reader.read(4) == []


def test_on_a_cluster_each_shards_read_counts_its_own_full_owners_lanes():
    import redis

    from kvgate.producer.keys import Keys
    from kvgate.worker.reader import Reader, ReadPlan, ShardGroup

    keys = Keys("t", shards=2, cluster=True)
    lane = lambda n, k: keys.jobs(None, "normal", n, k)  # noqa: E731
    plan = [lane(0, 0), lane(0, 1), lane(1, 1), lane(2, 0), lane(3, 0), lane(3, 1)]  # ours: 2, full owners': 3
    reader = Reader(redis.Redis(), "me", ReadPlan(plan, home=2, urgent=3), keys=keys)
    assert reader._by_shard(reader.plan, plan, []) == [
        ShardGroup(0, [lane(0, 0), lane(2, 0), lane(3, 0)], ["own", "urgent", "urgent"]),
        ShardGroup(1, [lane(0, 1), lane(1, 1), lane(3, 1)], ["own", "urgent", "other"])]


def test_owners_say_when_they_are_full_and_the_others_plan_to_take_their_lanes_at_once(queue):
    from kvgate.worker.affinity import Affinity

    keys = queue.keys
    me, peer = (Affinity(queue.r, keys, name, True, 4, 10_000) for name in ("me", "peer"))
    me.sync(), peer.sync(), me.sync()
    theirs = {keys.jobs(None, p, lane) for p in ("high", "normal", "low") for lane in peer.own[DEFAULT_MODEL]}

    def plan_after(room: bool) -> tuple[list[str], int]:
        pipe = queue.r.pipeline(transaction=False)
        peer.tell(pipe, room)
        pipe.execute()
        pipe = queue.r.pipeline(transaction=False)
        me.look(pipe)
        me.seen(pipe.execute())
        plan = me.read_plan()
        streams, home, urgent = plan.streams, plan.home, plan.urgent
        return streams[home:home + urgent], urgent

    assert plan_after(room=True) == ([], 0)
    urgent, n = plan_after(room=False)
    assert set(urgent) == theirs and n == len(theirs) and me.full == {"peer"}
    assert plan_after(room=True) == ([], 0)
    assert peer.tell(queue.r.pipeline(transaction=False), room=True) == 0  # unchanged, not due again: nothing to say
    plan_after(room=False)
    peer.leave()  # a draining worker is nobody's reason to steal at once any more
    assert not queue.r.exists(keys.lanes_full(None))
    peer.sync()  # back in the ring
    queue.r.zadd(keys.lanes_full(None), {"peer": 0, "killed": 0})  # a worker killed while full stays there...
    me.seen([[b"peer", b"killed"]])
    me.sync()  # ...until a beat finds it in no ring
    assert queue.r.zrange(keys.lanes_full(None), 0, -1) == [b"peer"] and me.full == {"peer"}


def test_lanes_work_on_the_embedded_redis_6_2(queue62, thread_worker):
    """The ring script stamps members with TIME before writing: allowed on 6.2 (effects replication) as on 7."""
    with thread_worker(q=queue62, affinity="on", affinity_lanes=4, heartbeat_interval_s=0.1) as tw:
        wait_for(lambda: tw.worker.affinity.own.get(DEFAULT_MODEL) == [0, 1, 2, 3], 10, "the only worker to own every lane")
        ids = submit_keyed(queue62, "s-1", 2, lanes=4, max_tokens=3)
        finals = queue62.wait_finals(2)
    assert sorted(f.job_id for f in finals) == sorted(ids)


# ---- lanes per model ---------------------------------------------------------------------------------------------

def test_each_model_has_its_own_ring_and_a_read_takes_every_models_own_lanes_before_any_steal(queue):
    from kvgate.worker.affinity import Affinity

    keys, prio = queue.keys, ("high", "normal", "low")
    me = Affinity(queue.r, keys, "me", True, 4, 10_000, models=("a", "b"))
    peer = Affinity(queue.r, keys, "peer", True, 4, 10_000, models=("b",))
    me.sync(), peer.sync(), me.sync()
    assert (queue.r.zcard(keys.lane_ring("a")), queue.r.zcard(keys.lane_ring("b"))) == (1, 2)
    assert me.own == {"a": [0, 1, 2, 3], "b": [0, 3]} and peer.own == {"b": [1, 2]}  # nobody else serves `a`
    plans = [me.read_plan() for _ in range(2)]
    for plan in plans:
        first, steals = plan.streams[:plan.home], plan.streams[plan.home:]
        assert set(first) == {keys.jobs(m, p, lane) for m, lanes in me.own.items() for lane in lanes for p in prio} \
            | {keys.jobs(m, p) for m in ("a", "b") for p in prio}
        assert steals == [keys.jobs("b", p, lane) for p in prio for lane in steals_of(steals, p)]
        assert set(steals) == {keys.jobs("b", p, lane) for p in prio for lane in (1, 2)}
        assert all(me.stolen(st) for st in steals) and not any(me.stolen(st) for st in first)
        assert [st.split(":")[3] for st in first] == sorted((st.split(":")[3] for st in first), key=prio.index)
    # models take turns at going first within a priority, as without lanes
    assert {plan.streams[0].split(":")[2] for plan in plans} == {"a", "b"}
    me.leave()
    assert queue.r.zcard(keys.lane_ring("a")) == 0 and queue.r.zcard(keys.lane_ring("b")) == 1


def steals_of(steals: list[str], priority: str) -> list[int]:
    return [int(st.rsplit(":", 1)[1]) for st in steals if st.split(":")[3] == priority]


def test_a_models_lanes_go_to_the_worker_that_serves_it(queue, spawn):
    for name in ("ma", "mb"):
        spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "2", *AFFINITY, "--served-model-name", name,
              "--no-serve-default", worker_id=f"w-{name}")
    wait_for(lambda: all(queue.r.zcard(queue.keys.lane_ring(m)) == 1 for m in ("ma", "mb")), 30, "both rings")
    assert not queue.r.exists(queue.keys.lane_ring(None))  # nobody serves `default`
    time.sleep(0.6)
    with Client(queue.server.url, queue.ns) as client:
        handles = {m: [client.submit("hi", model=m, prefix_key=f"s-{i}", max_tokens=2) for i in range(4)]
                   for m in ("ma", "mb")}
        served = {m: {h.result(timeout=30).worker for h in hs} for m, hs in handles.items()}
    assert served == {"ma": {"w-ma"}, "mb": {"w-mb"}}
    assert any(queue.r.exists(queue.keys.jobs("ma", "normal", lane)) for lane in range(LANES))  # routed into lanes


def entry_key(entry_id: bytes) -> tuple[int, int]:
    ms, seq = entry_id.split(b"-")
    return int(ms), int(seq)


def test_a_killed_owners_lane_jobs_are_reclaimed_while_the_survivors_own_lanes_keep_its_reads_full(queue, spawn):
    """Issue 26.7: a survivor busy with its own lanes took a killed owner's pending jobs only once its own backlog
    ran dry or the owner's ring beat expired (9.8-19.4 s against 2.4 s on the shared stream). The owner's beat here
    outlives the test, and the survivor's lane holds a minute of work: the reclaim must not wait for either."""
    keep_beat = ("--heartbeat-ttl-s", "120", "--reclaim-idle-ms", "2000")
    a = spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "50", "--max-num-seqs", "4", *keep_beat, *AFFINITY,
              worker_id="a")
    spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "5", "--max-num-seqs", "2", *keep_beat, *AFFINITY,
          "--affinity-steal-age-ms", "30000", "--affinity-max-lag-ms", "0", worker_id="b")  # a's jobs stay a's
    settled_ring(queue, 2)
    key_a, key_b = key_owned_by(queue, "a"), key_owned_by(queue, "b")
    lane_a = queue.keys.jobs(None, "normal", lane_of(routing_key(prefix_key=key_a), LANES))
    lane_b = queue.keys.jobs(None, "normal", lane_of(routing_key(prefix_key=key_b), LANES))
    ids = submit_keyed(queue, key_a, 4, max_tokens=200, ignore_eos=True)

    def held_by_a() -> int:
        return sum(row["consumer"] == b"a" for row in queue.r.xpending_range(lane_a, "workers", "-", "+", 10))

    wait_for(lambda: held_by_a() == 4, 20, lambda: f"the owner holds its 4 jobs ({held_by_a()})")
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    killed_at = time.monotonic()
    submit_keyed(queue, key_b, 600, max_tokens=40, ignore_eos=True)  # ~a minute of the survivor's own work
    wait_for(lambda: held_by_a() == 0, 30, lambda: f"the survivor reclaims the 4 jobs ({held_by_a()} still held)")
    print(f"reclaimed {time.monotonic() - killed_at:.1f} s after the kill")
    assert "a" in decode_members(queue.r.zrange(queue.keys.lane_ring(None), 0, -1))  # not by the ring beat expiring
    delivered = queue.r.xinfo_groups(lane_b)[0]["last-delivered-id"]  # not XINFO's lag: Redis 7 only
    newest = queue.r.xrevrange(lane_b, count=1)[0][0]
    assert entry_key(delivered) < entry_key(newest)  # nor by the survivor running out of its own work
    finals = wait_for(lambda: (f := [e for e in queue.finals() if e.job_id in ids]) and len(f) == 4 and f, 30,
                      "the 4 reclaimed jobs answered")
    assert {(f.worker, f.status, f.attempt) for f in finals} == {("b", "done", 2)}
