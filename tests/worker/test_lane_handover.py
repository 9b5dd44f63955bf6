"""Lanes whose jobs nobody waits on (issue 45): a killed owner's lanes before the ring drops it, and the lanes of a
model that only workers without affinity serve. Both kinds of job must be read like the shared stream's."""
from __future__ import annotations

import os
import signal
import time

from kvgate.producer.lanes import decode_members, lane_of, routing_key
from kvgate.producer.keys import DEFAULT_MODEL
from kvgate.producer.protocol import FIELD, encode
from kvgate.producer.submission import stream_for
from tests.support import wait_for
from tests.worker.test_affinity import AFFINITY, LANES, SIM, entry_key, key_owned_by, settled_ring, submit_keyed


def test_a_silent_members_lanes_are_read_as_ours_before_the_ring_drops_it(queue):
    from kvgate.worker.affinity import Affinity

    keys = queue.keys
    me, peer = (Affinity(queue.r, keys, name, True, 4, 60_000, lapse_ms=300) for name in ("me", "peer"))
    me.sync(), peer.sync(), me.sync()
    theirs = peer.own[DEFAULT_MODEL]
    assert theirs and set(me.own[DEFAULT_MODEL]).isdisjoint(theirs)
    time.sleep(0.4)  # the peer beats no more (killed), well inside the ring's 60 s ttl
    me.sync()
    assert "peer" in decode_members(queue.r.zrange(keys.lane_ring(None), 0, -1))  # still listed in the ring
    assert me.own[DEFAULT_MODEL] == [0, 1, 2, 3]  # but its lanes are ours: read first, blocked on when idle
    plan = me.read_plan()
    assert {keys.jobs(None, "normal", lane) for lane in theirs} <= set(plan.streams[:plan.home])
    peer.sync()  # back: it beats again and takes its lanes back
    me.sync()
    assert me.own[DEFAULT_MODEL] != [0, 1, 2, 3] and set(me.own[DEFAULT_MODEL]).isdisjoint(peer.own[DEFAULT_MODEL])


def test_jobs_queued_in_a_killed_owners_lane_are_read_while_it_is_still_in_the_ring_and_the_survivor_is_busy(
        queue, spawn):
    """Issue 45.8: a killed owner's pending jobs restart within the reclaim bound, but the jobs still queued in its
    lanes waited for the ring to drop it (up to 10.8 s), or for the survivor's own lanes to run dry. Here the ring
    keeps the owner 120 s, the survivor's own lane holds about a minute of work and it never steals (steal age 30 s,
    no max lag): the queued jobs must be read as the survivor's own once the owner's beat lapsed (the reclaim
    timeout, 2 s)."""
    keep_beat = ("--heartbeat-ttl-s", "120", "--reclaim-idle-ms", "2000")
    a = spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "5", *keep_beat, *AFFINITY, worker_id="a")
    spawn(queue.server.url, queue.ns, *SIM, "--sim-step-ms", "5", "--max-num-seqs", "2", *keep_beat, *AFFINITY,
          "--affinity-steal-age-ms", "30000", "--affinity-max-lag-ms", "0", worker_id="b")
    settled_ring(queue, 2)
    key_a, key_b = key_owned_by(queue, "a"), key_owned_by(queue, "b")
    lane_b = queue.keys.jobs(None, "normal", lane_of(routing_key(prefix_key=key_b), LANES))
    submit_keyed(queue, key_b, 900, max_tokens=40, ignore_eos=True)  # ~a minute and a half of the survivor's own work
    wait_for(lambda: queue.r.xinfo_groups(lane_b)[0]["pending"] >= 1, 20, "the survivor is busy with its own lane")
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    killed_at = time.monotonic()
    ids = submit_keyed(queue, key_a, 5, max_tokens=4)  # queued in the dead owner's lane, never delivered to it
    finals = wait_for(lambda: (f := [e for e in queue.finals() if e.job_id in ids]) and len(f) == 5 and f, 30,
                      lambda: f"the 5 jobs in the dead owner's lane answered "
                              f"({sum(e.job_id in ids for e in queue.finals())} of 5)")
    print(f"answered {time.monotonic() - killed_at:.1f} s after the kill")
    assert "a" in decode_members(queue.r.zrange(queue.keys.lane_ring(None), 0, -1))  # not by the ring dropping it
    delivered = queue.r.xinfo_groups(lane_b)[0]["last-delivered-id"]
    newest = queue.r.xrevrange(lane_b, count=1)[0][0]
    assert entry_key(delivered) < entry_key(newest)  # nor by the survivor running out of its own work
    assert {(f.worker, f.status, f.attempt) for f in finals} == {("b", "done", 1)}  # read as new jobs, not reclaimed


def test_lane_jobs_of_a_model_that_no_lane_owner_serves_wake_an_idle_worker_without_affinity(queue, thread_worker):
    """Issue 45: once lanes exist, a model served only by workers without affinity had its jobs routed into lanes
    that no idle worker waited on: each waited out a blocking read of the shared streams (201 ms at the median
    against 4 ms). Here that blocking read lasts 15 s: the job must wake the worker."""
    queue.r.set(queue.keys.lanes(), LANES)  # a worker with affinity on (of another model) gave the namespace lanes
    with thread_worker(served_model_name="mb", serve_default=False, block_ms=15_000, heartbeat_interval_s=0.2) as tw:
        wait_for(lambda: tw.worker.affinity.lanes == LANES and tw.worker.refill.empty_reads >= 1, 10,
                 "the worker knows the lanes and has found nothing to read")
        time.sleep(0.5)  # in its blocking read now
        job = queue.job("hi", max_tokens=2)
        stream = stream_for(job, "mb", queue.keys, LANES, "session-1")
        assert stream != queue.keys.jobs("mb", "normal")  # routed into a lane
        queue.r.xadd(stream, {FIELD: encode(job)})
        finals = queue.wait_finals(1, timeout=8)
    assert [(f.job_id, f.status) for f in finals] == [(job.job_id, "done")]
