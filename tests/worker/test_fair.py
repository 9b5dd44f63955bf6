"""Fair share across tenants through the queue (worker/fair.py): a flood does not starve a second tenant, weights
hold, a SIGKILLed worker's jobs are answered once, and tenant ids a producer controls neither stop a worker nor make
a read cost O(tenants)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from kvgate import Client
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD
from kvgate.worker.reader import Reader, ReadPlan
from tests.support import fair_enqueue, wait_for

SIM = ("--simulated", "--sim-num-blocks", "1024", "--sim-per-token-ms", "0.01", "--heartbeat-interval-s", "0.2")


def band(queue, priority: str = "normal") -> str:
    return queue.keys.jobs(None, priority)


def enqueue(queue, tenant: str, n: int, priority: str = "normal", **sampling) -> list[str]:
    """Jobs as the SDK enqueues them with fair share on: the tenant's stream, and the tenant in the backlog."""
    jobs = [queue.job("same prompt", tenant=tenant, priority=priority, **sampling) for _ in range(n)]
    pipe = queue.r.pipeline(transaction=True)
    ids = fair_enqueue(queue.r, band(queue, priority), jobs, pipe)
    pipe.execute()
    return ids


def done(queue, ids: list[str]) -> int:
    pipe = queue.r.pipeline(transaction=False)
    for job_id in ids:
        pipe.exists(queue.keys.result(job_id))
    return sum(pipe.execute())


def test_a_flood_from_one_tenant_does_not_starve_another(queue, thread_worker):
    queue.r.set(queue.keys.fair(), 1)  # the namespace's switch, as `--fair-share on` sets it
    with Client(queue.server.url, queue.ns, tenant="flood") as a, Client(queue.server.url, queue.ns, tenant="b") as b:
        flood = a.submit_many([{"prompt": "x", "max_tokens": 8, "ignore_eos": True}] * 400)
        small = [b.submit("y", max_tokens=8, ignore_eos=True) for _ in range(5)]
        assert queue.r.zscore(Keys.fair_backlog(band(queue)), "b") is not None  # the SDK routed by tenant
        with thread_worker(max_num_seqs=2):
            for h in small:
                assert h.result(timeout=60).status == "done"
            served = done(queue, [h.job_id for h in flood])
            assert served < 100, f"b waited behind {served} of the flood's 400 jobs"
            for h in flood[-3:]:
                assert h.result(timeout=60).status == "done"  # work-conserving: the flood is served too


def test_weights_two_to_one_hold_while_both_are_backlogged(queue, thread_worker):
    queue.r.set(queue.keys.fair(), 1)
    queue.r.hset(queue.keys.tenants(), mapping={"heavy": 2})
    heavy = enqueue(queue, "heavy", 300, max_tokens=8, ignore_eos=True)
    light = enqueue(queue, "light", 300, max_tokens=8, ignore_eos=True)
    with thread_worker(max_num_seqs=4):
        wait_for(lambda: done(queue, heavy) + done(queue, light) >= 150, 60, "150 jobs served")
        h, l = done(queue, heavy), done(queue, light)
    assert h < 300 and l < 300  # both still backlogged
    assert abs(h / (h + l) - 2 / 3) <= 0.15 * 2 / 3, (h, l)


def test_a_new_tenant_is_not_owed_credit_for_its_idle_time(queue, thread_worker):
    """A tenant that arrives after another has been served a long while gets an equal share from then on, not the
    fleet to itself until its counter catches up."""
    queue.r.set(queue.keys.fair(), 1)
    old = enqueue(queue, "old", 400, max_tokens=8, ignore_eos=True)
    with thread_worker(max_num_seqs=4):
        wait_for(lambda: done(queue, old) >= 100, 60, "100 of the old tenant's jobs served")
        before = done(queue, old)
        new = enqueue(queue, "new", 200, max_tokens=8, ignore_eos=True)
        wait_for(lambda: done(queue, new) >= 60, 60, "60 of the new tenant's jobs served")
        gained = done(queue, old) - before
    assert gained >= 30, f"the old tenant got {gained} jobs while the new one got 60"


def test_a_new_tenant_starts_at_the_lowest_counter_backlogged_when_that_is_above_the_virtual_time(queue):
    """Counters also move where no read moves the band's virtual time: corrections, and on a cluster what tenants
    took in the other shards (Fair.flush). A tenant that joins then starts where the backlogged tenants are, not at
    the virtual time below them, or it would be owed what they took elsewhere."""
    r, stream = queue.r, band(queue)
    r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    enqueue(queue, "a", 10)
    r.zadd(Keys.fair_backlog(stream), {"a": 500})  # a took 5 jobs of 100 tokens elsewhere; no read here yet
    enqueue(queue, "b", 10)
    got = Reader(r, "w1", ReadPlan([stream], fair={stream}, charge=100)).read(8)
    tenants = [e.stream.rsplit(":t:", 1)[1] for e in got]
    assert tenants.count("a") == 4 and tenants.count("b") == 4, tenants  # b at a's 500: a quantum each


def test_jobs_read_while_their_tenant_was_alone_keep_their_charge_so_a_newcomer_is_owed_nothing(queue):
    """A tenant alone in a band is read at the estimate; one that joins starts at its counter. When those jobs end
    smaller than charged, the refund lands after the newcomer joined: it must not put the first tenant ahead of it
    (W-FAIR at 0.1 scale: an idle fleet's first fill of a flood at the cold estimate, refunded after B and C joined,
    gave A 0.51 of the first 5 s window at equal weights). Jobs read while others were backlogged still are."""
    from kvgate.worker.fair import Fair, tenant_of

    r, stream = queue.r, band(queue)
    r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    reader = Reader(r, "w1", ReadPlan([stream], fair={stream}, charge=512))
    enqueue(queue, "a", 40)
    first = reader.read(8)
    assert len(first) == 8 and all(e.alone for e in first)
    enqueue(queue, "b", 40)
    second = reader.read(2)  # b joins at a's counter, charged as it goes
    assert [tenant_of(e.stream, stream) for e in second] == ["b", "b"] and not any(e.alone for e in second)
    fair = Fair(r, queue.keys, "keep", bands={stream})
    fair.read(first + second, 512)
    for e in first + second:  # each took 16 tokens of the 512 charged
        fair.finished(e.stream, e.entry_id, tenant_of(e.stream, stream), 16)
    fair.flush()
    tenants = [tenant_of(e.stream, stream) for e in reader.read(8)]
    assert tenants.count("a") == 4 and tenants.count("b") == 4, tenants  # b refunded its 2, a none: b 2 jobs ahead


def test_priority_bands_stay_strict_under_fair_share(queue, thread_worker):
    queue.r.set(queue.keys.fair(), 1)
    low = enqueue(queue, "a", 100, priority="low", max_tokens=8, ignore_eos=True)
    high = enqueue(queue, "b", 20, priority="high", max_tokens=8, ignore_eos=True)
    with thread_worker(max_num_seqs=2):
        wait_for(lambda: done(queue, low) == 100, 60, "both bands served")
    order = [f.job_id for f in queue.finals()]
    first_low = min(order.index(i) for i in low)
    assert first_low >= 16, order[:20]  # low jobs start only as the last high ones run (2 slots, 4 queued)


def test_a_worker_sigkilled_under_fair_share_loses_nothing_and_answers_nothing_twice(queue, spawn):
    queue.r.set(queue.keys.fair(), 1)
    ids = [i for t in ("a", "b", "c") for i in enqueue(queue, t, 20, max_tokens=30, ignore_eos=True)]
    reclaim = ("--reclaim-idle-ms", "800", "--fair-share", "on")
    victim = spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "20", *reclaim, worker_id="victim")
    wait_for(lambda: queue.r.zcard(Keys.fair_pending(band(queue))) > 0, 30, "the victim reading tenants' streams")
    time.sleep(0.3)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "2", *reclaim, worker_id="survivor")
    finals = queue.wait_finals(len(ids), timeout=60)
    time.sleep(0.5)  # nothing more comes
    finals = queue.finals()
    assert sorted(f.job_id for f in finals) == sorted(ids)  # every job once
    assert any(f.worker == "survivor" for f in finals)


def test_a_hostile_backlog_member_does_not_stop_a_worker(queue, thread_worker):
    """A member whose stream is not a stream (a producer with raw Redis access) is dropped; others are served."""
    queue.r.set(queue.keys.fair(), 1)
    queue.r.set(Keys.tenant_jobs(band(queue), "evil"), "not a stream")
    queue.r.zadd(Keys.fair_backlog(band(queue)), {"evil": 0, "ghost": 0})  # and one with no stream at all
    ids = enqueue(queue, "good", 5, max_tokens=4)
    with thread_worker():
        wait_for(lambda: done(queue, ids) == 5, 30, "the good tenant served")
    assert queue.r.zscore(Keys.fair_backlog(band(queue)), "evil") is None


def test_a_read_and_a_reclaim_cost_the_same_with_100000_tenants(queue):
    """One read takes from the lowest counters and a reclaim looks at a bounded slice of the pending index: the
    commands a read runs do not grow with the tenants backlogged."""
    r, stream = queue.r, band(queue)
    r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)

    def commands() -> int:
        return sum(v["calls"] for k, v in r.info("commandstats").items() if k != "cmdstat_info")

    def read_cost(reclaim_ms: int) -> tuple[int, int]:
        reader = Reader(r, "w1", ReadPlan([stream], fair={stream}, charge=16))
        before = commands()
        got = reader.read(8, reclaim_idle_ms=reclaim_ms)
        return len(got), commands() - before

    enqueue(queue, "t0", 1)
    small = read_cost(0)
    for start in range(0, 100_000, 20_000):
        tenants = {f"t{i}": 0 for i in range(start, start + 20_000)}
        r.zadd(Keys.fair_backlog(stream), tenants)
        r.zadd(Keys.fair_pending(stream), tenants)
    enqueue(queue, "t1", 1)
    large = read_cost(0)
    assert large[0] <= 8 and large[1] <= 8 * 64  # each turn takes a job or drops a tenant; at most 64 turns
    reclaim = read_cost(100)
    assert reclaim[1] <= 8 * 64 + 8 * 64, (small, large, reclaim)
    assert r.zcard(Keys.fair_backlog(stream)) >= 100_000 - 2 * 64  # looked at a slice, not all


def test_an_idempotent_submit_under_fair_share_joins_its_tenants_backlog_once(queue, thread_worker):
    queue.r.set(queue.keys.fair(), 1)
    with Client(queue.server.url, queue.ns, tenant="acme") as client:
        first = client.submit("hi", max_tokens=4, idempotency_key="order-1")
        again = client.submit("hi", max_tokens=4, idempotency_key="order-1")
        assert again.job_id == first.job_id
        assert queue.r.xlen(Keys.tenant_jobs(band(queue), "acme")) == 1
        assert queue.r.zscore(Keys.fair_backlog(band(queue)), "acme") == float("-inf")  # placed when first read
        with thread_worker():
            assert first.result(timeout=30).status == "done"


def test_tenants_share_tokens_not_jobs_when_their_jobs_differ_in_length(queue, thread_worker):
    """Counters are corrected by what a job really took: a tenant of long jobs gets as many tokens as one of short
    jobs, so fewer jobs (alternating jobs would give it 8 times the tokens)."""
    queue.r.set(queue.keys.fair(), 1)
    short = enqueue(queue, "short", 800, max_tokens=4, ignore_eos=True)
    long_ = enqueue(queue, "long", 100, max_tokens=60, ignore_eos=True)
    def served() -> dict[str, int]:
        finals = {f.job_id: f for f in queue.finals()}
        return {name: sum(finals[i].usage.prompt_tokens + finals[i].usage.completion_tokens
                          for i in ids if i in finals) for name, ids in (("short", short), ("long", long_))}

    with thread_worker(max_num_seqs=4):
        wait_for(lambda: done(queue, long_) >= 10, 60, "10 long jobs served")
        before = served()  # from here on: the first reads charged the initial estimate
        wait_for(lambda: done(queue, long_) >= 60, 60, "60 long jobs served")
        after = served()
    assert done(queue, short) < 800  # still backlogged
    tokens = {name: after[name] - before[name] for name in after}
    assert abs(tokens["short"] - tokens["long"]) <= 0.3 * max(tokens.values()), tokens


def test_stats_count_the_jobs_waiting_in_tenants_streams(queue, thread_worker):
    """The backlog stays visible (kvgate stats, the exporter, the backlog gate) without a look at every tenant."""
    queue.r.set(queue.keys.fair(), 1)
    queue.r.sadd(queue.keys.models(), "default")
    with Client(queue.server.url, queue.ns, tenant="a") as client:
        handles = client.submit_many([{"prompt": "x", "max_tokens": 4}] * 7)
        handles.append(client.submit("y", max_tokens=4, idempotency_key="k1"))
        stats = client.stats()
        assert stats.backlog == 8 and stats.priorities["normal"].backlog == 8
        with thread_worker():
            for h in handles:
                assert h.result(timeout=30).status == "done"
        assert client.stats().backlog == 0


def test_weights_that_are_no_positive_number_count_as_one():
    from kvgate.worker.tenant_weights import parse_weights

    raw = {b"a": b"2", b"b": b"zero", b"c": b"-1", b"d": b"nan", b"e": b"1", b"f": b"0.5", b"g": b"inf"}
    assert parse_weights(raw)[0] == {"a": 2.0, "f": 0.5}


def test_tenants_streams_are_served_by_a_worker_with_affinity_lanes(queue, thread_worker):
    """Fair share and lanes in one namespace: the read plan with lanes still reads the bands' tenants."""
    queue.r.set(queue.keys.fair(), 1)
    ids = enqueue(queue, "a", 5, max_tokens=4) + enqueue(queue, "b", 5, max_tokens=4)
    with thread_worker(affinity="on", affinity_lanes=4):
        wait_for(lambda: done(queue, ids) == 10, 30, "both tenants served")


def test_entries_a_lost_reply_delivered_from_tenants_streams_are_read_again_at_once(queue):
    """After a Redis error the worker reads what is pending to it first; under fair share that covers the tenants'
    streams it read lately, not only the shared ones (else they would wait for the reclaim timeout)."""
    from tests.worker.conftest import ThreadWorker

    queue.r.set(queue.keys.fair(), 1)
    ids = enqueue(queue, "a", 2, max_tokens=4)
    worker = ThreadWorker(queue, reclaim_idle_ms=60_000).worker  # not started: driven by hand
    worker._ensure_groups()
    got = worker.refill.read_idle(2)  # delivered to us, then "lost" with the reply
    assert len(got) == 2 and all(":t:a" in e.stream for e in got)
    worker.refill.rewind(worker.streams)
    again = [e for batch in worker.refill.read_own_pending(10, lambda stream, entry: False) for e in batch]
    assert sorted(e.entry_id for e in again) == sorted(e.entry_id for e in got)
    assert len(ids) == 2


# ---- latency beside a flood: a waiting tenant under its share makes room (worker/fair.py, fair_preempt_ms) ----

def preempt_look(queue, occupancy: dict, preempt_ms: int = 50):
    from kvgate.worker.fair import Occupancy

    bands = [band(queue, p) for p in ("high", "normal")]
    plan = ReadPlan(bands, fair=set(bands), charge=16, preempt_ms=preempt_ms,
                    occupancy={band(queue, p): Occupancy(counts) for p, counts in occupancy.items()})
    return Reader(queue.r, "w1", plan).read(1)


def test_the_preempting_look_takes_a_waited_job_of_a_tenant_under_its_share_and_nothing_else(queue):
    flood, small = enqueue(queue, "flood", 3), enqueue(queue, "small", 2)
    time.sleep(0.08)
    assert preempt_look(queue, {"normal": {"flood": 4}}, preempt_ms=10_000) == []  # not waited long enough
    assert preempt_look(queue, {"normal": {"flood": 3, "small": 3}}) == []  # small holds its share here
    got = preempt_look(queue, {"normal": {"flood": 4}})
    assert [e.stream for e in got] == [Keys.tenant_jobs(band(queue), "small")]  # one job: the lowest under its cap
    assert preempt_look(queue, {}) == []  # a band we did not say we are full in is not looked at
    assert len(flood) == 3 and len(small) == 2



def occupancy(counts: dict[str, int], backlogged: tuple[str, ...] = (), weights: dict[str, float] | None = None):
    from kvgate.worker.fair import Occupancy

    return Occupancy(dict(counts), set(backlogged), dict(weights or {}))


def test_shares_of_a_workers_jobs_follow_the_weights_so_a_heavier_tenant_does_not_give_way_at_an_equal_share():
    """W-FAIR at 2:1:1 on a cluster: near the end of the phase B's and C's few waiting jobs made room by displacing
    A's, whose share was counted as an equal third, and A's share of the fleet fell from a half to a third."""
    weighted = {"a": 2.0}
    assert occupancy({"a": 4, "b": 2}, ("a",)).makes_room("b")  # equal weights: a above a half
    assert not occupancy({"a": 4, "b": 2}, ("a",), weighted).makes_room("b")  # a's two thirds: b at its own
    assert occupancy({"a": 4, "b": 2}, ("a",), weighted).share("b", of="a") == 7 * 2 / 3
    assert occupancy({"a": 5, "b": 1}, ("a",), weighted).over("b") == ("a",)  # 5 of 7 is above two thirds
    assert occupancy({"a": 4, "b": 2}, ("a",), weighted).over("c") == ("a", "b")  # with c: a 3.5 of 7, b 1.75
    assert not occupancy({"a": 1, "b": 4}, (), {"b": 4.0}).makes_room("a")  # b's 4 of 6 are within its 4/5


def test_a_job_makes_room_within_its_share_and_backlogged_tenants_give_way_at_theirs():
    """Shares count the jobs running plus the one that would start. A newcomer beside two flood jobs may make room
    (it ends one of two); a tenant with few jobs waiting is displaced only above its share; a backlogged one also
    at it, since it never makes room back; and a tenant at its share makes no room."""
    assert occupancy({"flood": 2}, ("flood",)).makes_room("b")
    assert occupancy({"flood": 2}, ("flood",)).makes_room()  # what the preempting look asks for one not here
    assert occupancy({"flood": 1}, ("flood",)).makes_room("b")  # one seat (a small worker): the newcomer's half
    assert not occupancy({"c": 1}).makes_room("b")  # c has few waiting and holds no more than its share
    assert occupancy({"flood": 3, "c": 2}, ("flood",)).makes_room("c")  # the flood holds its share: 3 of 6
    assert not occupancy({"b": 3, "c": 2}).makes_room("c")  # b has few jobs waiting: not above its share
    assert occupancy({"b": 4, "c": 2}).makes_room("c") and occupancy({"b": 4, "c": 2}).over("c") == ("b",)
    assert not occupancy({"flood": 3, "c": 3}, ("flood",)).makes_room("c")  # c at its share already
    assert occupancy({"flood": 61, "b": 4, "c": 1}, ("flood",)).over("b") == ("flood",)


def test_a_job_that_made_room_is_never_displaced_by_those_it_displaced():
    """Whatever the counts, once a job of `t` made room (one more of t's, one fewer of a victim's), no job of that
    victim may make room against t: no ping-pong, whoever has few jobs waiting."""
    for a in range(1, 12):
        for b in range(0, 12):
            for backlogged in ((), ("a",)):
                here = occupancy({"a": a, **({"b": b} if b else {})}, backlogged)
                if not here.makes_room("b"):
                    continue
                after = occupancy({"a": a - 1, "b": b + 1} if a > 1 else {"b": b + 1}, backlogged)
                assert "b" not in after.over("a") or not after.makes_room("a"), (a, b, backlogged)


def test_a_light_tenants_second_job_makes_room_while_the_first_ones_victim_waits(queue, thread_worker):
    """Beside a flood that fills every seat, each job of a tenant with few waiting makes room in turn: the look that
    finds the second is not held back by the flood job that stepped aside for the first (it waits in the engine)."""
    from kvgate.engine.simulated import SimulatedEngine

    queue.r.set(queue.keys.fair(), 1)
    flood = enqueue(queue, "flood", 8, max_tokens=600, ignore_eos=True)
    engine = SimulatedEngine(num_blocks=512, block_size=16, max_num_seqs=4, step_overhead_s=0.01, per_token_s=0.0)
    with thread_worker(engine=engine, fair_preempt_ms=30):
        wait_for(lambda: engine.stats.running == 4, 10, "the flood filling every seat")
        small = enqueue(queue, "small", 1, max_tokens=400, ignore_eos=True)
        wait_for(lambda: engine.stats.stepped_aside >= 1, 10, "the first job making room")
        small += enqueue(queue, "small", 1, max_tokens=4, ignore_eos=True)
        wait_for(lambda: done(queue, small[1:]) == 1, 30, "the second job answered")
        before = done(queue, flood + small[:1])  # nothing else ended: the second did not wait for a seat to free
        queue.wait_finals(10, timeout=120)
    assert before == 0 and engine.stats.stepped_aside >= 2
    assert sorted(f.job_id for f in queue.finals()) == sorted(flood + small)  # each once


def test_a_read_that_drains_a_tenants_stream_marks_its_jobs_few_whatever_it_asked(queue):
    """A full worker refills one seat at a time: a read of 1 that takes a tenant's only job drained the stream, so
    that job may make room; a read of 1 of 2 did not."""
    enqueue(queue, "solo", 1)
    stream = band(queue)
    queue.r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    got = Reader(queue.r, "w1", ReadPlan([stream], fair={stream}, charge=16)).read(1)
    assert [(e.stream, e.may_preempt) for e in got] == [(Keys.tenant_jobs(stream, "solo"), True)]
    enqueue(queue, "pair", 2)
    got = Reader(queue.r, "w1", ReadPlan([stream], fair={stream}, charge=16)).read(1)
    assert [(e.stream, e.may_preempt) for e in got] == [(Keys.tenant_jobs(stream, "pair"), False)]


def test_only_a_tenant_with_few_jobs_waiting_may_make_room(queue):
    """A long backlog's wait is its own doing, and backlogged tenants share by their counters: only a tenant with at
    most 32 jobs waiting, all read, gets jobs that may make room (Entry.may_preempt)."""
    enqueue(queue, "big", 40)
    enqueue(queue, "small", 2)
    time.sleep(0.08)
    got = preempt_look(queue, {"normal": {"x": 4}})
    assert [(e.stream, e.may_preempt) for e in got] == [(Keys.tenant_jobs(band(queue), "small"), True)]  # not big
    stream = band(queue)
    queue.r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    got = Reader(queue.r, "w2", ReadPlan([stream], fair={stream}, charge=16)).read(9)
    marks = [(e.stream.rpartition(":t:")[2], e.may_preempt) for e in got]
    assert [m for t, m in marks if t == "small"] == [True]  # its last job: it drained the stream
    assert [m for t, m in marks if t == "big"] == [False] * 8, marks  # 40 waiting: not few

def test_the_preempting_look_keeps_priorities_strict(queue):
    enqueue(queue, "small", 1)
    enqueue(queue, "other", 1, priority="high")  # a higher band has tenants waiting: nothing lower jumps them
    time.sleep(0.08)
    assert preempt_look(queue, {"normal": {"flood": 4}}) == []
    got = preempt_look(queue, {"high": {"flood": 4}})
    assert [e.stream for e in got] == [Keys.tenant_jobs(band(queue, "high"), "other")]


@pytest.mark.parametrize("preempt_ms", [50, 0])
def test_a_job_beside_a_flood_that_fills_the_worker_starts_without_waiting_for_the_flood(queue, thread_worker,
                                                                                        preempt_ms):
    """The flood's long jobs take every seat. A second tenant's job that waited fair_preempt_ms makes room: the
    flood's youngest job steps aside and resumes after it, every job answered once. With 0 it waits for a flood job
    to end, as before."""
    from kvgate.engine.simulated import SimulatedEngine

    queue.r.set(queue.keys.fair(), 1)
    flood = enqueue(queue, "flood", 6, max_tokens=150, ignore_eos=True)
    engine = SimulatedEngine(num_blocks=512, block_size=16, max_num_seqs=4, step_overhead_s=0.01, per_token_s=0.0)
    with thread_worker(engine=engine, fair_preempt_ms=preempt_ms):
        wait_for(lambda: engine.stats.running == 4, 10, "the flood filling every seat")
        small = enqueue(queue, "small", 1, max_tokens=4, ignore_eos=True)
        wait_for(lambda: done(queue, small) == 1, 30, "the small tenant's job answered")
        flood_done = done(queue, flood)
        queue.wait_finals(7, timeout=60)
    assert sorted(f.job_id for f in queue.finals()) == sorted(flood + small)  # each once
    if preempt_ms:
        assert flood_done == 0 and engine.stats.stepped_aside >= 1 and engine.stats.preemptions == 0
    else:
        assert flood_done >= 1 and engine.stats.stepped_aside == 0


def test_the_status_of_a_bare_job_id_finds_it_running_in_its_tenants_stream(queue):
    """Client.status(job_id) from a client that did not submit the job: under fair share the entry a worker holds
    sits in a tenant's stream, found through the band's pending index (not a scan of every tenant)."""
    queue.r.set(queue.keys.fair(), 1)
    with Client(queue.server.url, queue.ns, tenant="acme") as producer:
        handle = producer.submit("hi", max_tokens=4)
    got = Reader(queue.r, "w1", ReadPlan([band(queue)], fair={band(queue)})).read(1)
    assert [e.stream for e in got] == [Keys.tenant_jobs(band(queue), "acme")]
    with Client(queue.server.url, queue.ns) as other:
        status = other.status(handle.job_id)
        assert (status.state, status.worker) == ("running", "w1"), status
        assert other.status("no-such-job").state == "unknown"


def test_a_tenants_stream_is_deleted_once_it_is_empty_and_its_tenant_is_not_backlogged(queue, thread_worker):
    """One stream per tenant that ever had a job must not stay forever: the worker's pruning pass deletes it once
    nothing waits in it and nothing is pending there; a later job of the tenant makes it again and is served."""
    queue.r.set(queue.keys.fair(), 1)
    stream = Keys.tenant_jobs(band(queue), "acme")
    with Client(queue.server.url, queue.ns, tenant="acme") as client:
        with thread_worker(reclaim_idle_ms=200, trim_interval_s=0.1):
            assert client.submit("hi", max_tokens=4).result(timeout=30).status == "done"
            wait_for(lambda: not queue.r.exists(stream), 10, "the empty tenant's stream deleted")
            assert queue.r.zscore(Keys.fair_streams(band(queue)), "acme") is None
            assert client.submit("again", max_tokens=4).result(timeout=30).status == "done"


def test_the_sweep_keeps_a_stream_with_work_and_prunes_its_departed_consumers(queue):
    """A tenant's stream with an entry pending, or one not yet read, or its tenant backlogged, stays; its departed
    consumers (idle, nothing pending, no heartbeat) go; a live worker's consumer stays."""
    from kvgate.worker.fair import Fair

    r, b = queue.r, band(queue)
    busy, fresh = Keys.tenant_jobs(b, "busy"), Keys.tenant_jobs(b, "fresh")
    for stream in (busy, fresh):
        r.xadd(stream, {FIELD: b"x"})
        r.xgroup_create(stream, Keys.GROUP, id="0")
    r.xreadgroup(Keys.GROUP, "holder", {busy: ">"}, count=1)  # pending to a consumer with no heartbeat: reclaim's
    r.xgroup_createconsumer(busy, Keys.GROUP, "ghost")
    r.xgroup_createconsumer(busy, Keys.GROUP, "alive")
    r.hset(queue.keys.worker("alive"), "state", "serving")
    r.zadd(Keys.fair_streams(b), {"busy": 0, "fresh": 0, "gone": 0})
    time.sleep(0.15)
    swept = Fair(r, queue.keys, "keep", {b}).sweep(100, "me")
    assert r.exists(busy) and r.exists(fresh)
    names = {c["name"] for c in r.xinfo_consumers(busy, Keys.GROUP)}
    assert names == {b"holder", b"alive"}, names
    assert swept.consumers == ["ghost"] and swept.deleted == 0
    assert r.zscore(Keys.fair_streams(b), "gone") is None  # no stream: forgotten
    assert r.zscore(Keys.fair_streams(b), "busy") > 0  # looked at: again after min idle


def test_a_sweep_looks_at_a_bounded_slice_with_100000_tenants(queue):
    from kvgate.worker.fair import Fair
    from kvgate.worker.fair_sweep import SWEEP_TENANTS

    r, b = queue.r, band(queue)
    for start in range(0, 100_000, 20_000):
        r.zadd(Keys.fair_streams(b), {f"t{i}": 0 for i in range(start, start + 20_000)})
    r.zadd(Keys.fair_backlog(b), {f"t{i}": 0 for i in range(0, 100_000, 2)})
    before = sum(v["calls"] for k, v in r.info("commandstats").items() if k != "cmdstat_info")
    Fair(r, queue.keys, "keep", {b}).sweep(100, "me")
    cost = sum(v["calls"] for k, v in r.info("commandstats").items() if k != "cmdstat_info") - before
    assert cost <= SWEEP_TENANTS * 8, cost
    assert r.zcard(Keys.fair_streams(b)) >= 100_000 - SWEEP_TENANTS


def test_a_rewind_after_a_tenants_stream_was_deleted_reads_the_others(queue):
    """A worker rewinds over the tenants' streams it read lately; one the pruning pass deleted since (no group now)
    must not fail the read of the others."""
    from tests.worker.conftest import ThreadWorker

    queue.r.set(queue.keys.fair(), 1)
    enqueue(queue, "a", 1, max_tokens=4)
    enqueue(queue, "b", 1, max_tokens=4)
    worker = ThreadWorker(queue, reclaim_idle_ms=60_000).worker  # not started: driven by hand
    worker._ensure_groups()
    got = worker.refill.read_idle(2)
    assert {e.stream for e in got} == {Keys.tenant_jobs(band(queue), t) for t in "ab"}
    queue.r.delete(Keys.tenant_jobs(band(queue), "a"))  # as the sweep does once a's stream is empty
    worker.refill.rewind(worker.streams)
    again = [e for batch in worker.refill.read_own_pending(10, lambda stream, entry: False) for e in batch]
    assert [e.stream for e in again] == [Keys.tenant_jobs(band(queue), "b")]
    assert worker.refill.read_own_pending(10, lambda stream, entry: True) == []  # past b's: nothing more
    assert not worker.refill.own_pending


def test_an_idle_fair_worker_blocks_until_a_tenant_rings_its_bands_bell(queue, thread_worker):
    """An idle worker under fair share waits on a blocking read (the bands' bells with its shared streams) rather
    than polling every 50 ms, and a job a tenant enqueues wakes it at once, not at the end of its wait."""
    queue.r.set(queue.keys.fair(), 1)

    def reads() -> int:
        stats = queue.r.info("commandstats")
        return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("xread", "xreadgroup", "evalsha"))

    with thread_worker(block_ms=3000, heartbeat_interval_s=10, trim_interval_s=10, reclaim_idle_ms=60_000):
        warm = enqueue(queue, "acme", 1, max_tokens=2)
        wait_for(lambda: done(queue, warm) == 1, 30, "the first job served")
        time.sleep(0.3)
        before = reads()
        time.sleep(1.0)
        idle_reads = reads() - before
        waits = []
        for tenant in ("acme", "acme", "other"):
            started = time.monotonic()
            ids = enqueue(queue, tenant, 1, max_tokens=2)
            wait_for(lambda: done(queue, ids) == 1, 30, "the job served")
            waits.append(time.monotonic() - started)
            time.sleep(0.3)
    assert idle_reads <= 6, f"an idle worker made {idle_reads} reads in 1 s"
    assert max(waits) < 1.5, f"jobs waited {waits} s for an idle worker blocking 3 s"


def test_tenant_weights_from_a_file_replace_the_namespaces_hash_at_start(queue, tmp_path):
    """`kvgate worker --tenant-weights FILE`: the file's weights go to `{ns}:tenants` (replacing what was there), so
    every worker, with the file or without, serves by the same weights."""
    from tests.worker.conftest import ThreadWorker

    path = tmp_path / "weights.toml"
    path.write_text('[weights]\nteam-a = 2\n"batch.jobs" = 0.5\n')
    queue.r.hset(queue.keys.tenants(), mapping={"stale": 3, "team-a": 5})
    worker = ThreadWorker(queue, tenant_weights=str(path)).worker  # not started: its start writes them
    assert queue.r.hgetall(queue.keys.tenants()) == {b"team-a": b"2.0", b"batch.jobs": b"0.5"}
    worker.fair.sync()  # as its heartbeat does
    assert worker.fair.weights == {"team-a": 2.0, "batch.jobs": 0.5}


@pytest.mark.parametrize("text, says", [
    ("[weights]\nteam-a = 0\n", "team-a: weight 0 must be a number from 0.001 to 1000"),
    ("[weights]\nteam-a = 'x'\n", "team-a: weight 'x' must be a number from 0.001 to 1000"),
    ("[weights]\n'bad name!' = 2\n", "tenant 'bad name!' must be"),
    ("[weigths]\nteam-a = 2\n", "unknown table [weigths]: the file has one table, [weights]"),
    ("[weights\n", "not TOML"),
])
def test_a_bad_tenant_weights_file_stops_the_start_saying_what_is_wrong(tmp_path, text, says):
    from pydantic import ValidationError

    from kvgate.worker.settings import WorkerSettings

    path = tmp_path / "weights.toml"
    path.write_text(text)
    with pytest.raises(ValidationError) as caught:
        WorkerSettings(tenant_weights=str(path))
    assert f"tenant weights file {path}" in str(caught.value) and says in str(caught.value), str(caught.value)


def test_a_tenant_weights_file_over_the_weights_a_worker_reads_is_refused(tmp_path):
    from pydantic import ValidationError

    from kvgate.worker.tenant_weights import MAX_WEIGHTS
    from kvgate.worker.settings import WorkerSettings

    path = tmp_path / "weights.toml"
    path.write_text("[weights]\n" + "".join(f"t{i} = 2\n" for i in range(MAX_WEIGHTS + 1)))
    with pytest.raises(ValidationError, match=f"{MAX_WEIGHTS + 1} tenants; workers read {MAX_WEIGHTS} at most"):
        WorkerSettings(tenant_weights=str(path))
