"""W-FLEET harness: a tiny simulated fleet on a real redis-server answers every job exactly once."""
from __future__ import annotations

import json
import time
from argparse import Namespace

import pytest

from kvgate.producer.keys import Keys
from kvgate.bench import fleet_sim
from kvgate.bench.fleet import fleet_capacity, percentile, run_latency, summarise


def _args(**kw) -> Namespace:
    base = dict(jobs=50, seconds=1.0, load=0.6, step_ms=2.0, per_token_ms=0.01, seed=1)
    return Namespace(**{**base, **kw})


@pytest.mark.parametrize("policy", ["capacity", "prefetch"])
def test_two_workers_answer_each_of_50_jobs_exactly_once(shared_redis, policy):
    r = run_latency(shared_redis.url, 2, policy, _args(load=50.0))  # 50 jobs arrive almost at once
    assert r.jobs == 50 and r.answered_once
    assert 0 < r.p50_wait_s <= r.p99_wait_s and r.jobs_per_s > 0 and 0 < r.kv_utilisation <= 1


def test_a_job_answered_twice_fails_the_run(shared_redis, namespace):
    keys, client = Keys(namespace), shared_redis.client()
    jobs = fleet_sim.make_jobs(2, fleet_sim.JobMix(max_tokens=(2, 2)), seed=0, clients=1)
    fleet = fleet_sim.start_fleet(shared_redis.url, namespace, fleet_sim.mixed_fleet(1), "capacity",
                                  step_overhead_s=0.001, per_token_s=0.0)
    try:
        fleet_sim.enqueue(client, keys, jobs, rate=None)
        finals = {}
        for _ in range(200):
            finals = fleet_sim.collect_finals(client, keys, 1)
            if len(finals) == 2:
                break
            time.sleep(0.05)
    finally:
        fleet.stop()
    reply = keys.reply("bench-0")
    entry = client.xrange(reply, count=1)[0][1]
    client.xadd(reply, entry)  # forge a second final for the first job
    r = summarise("capacity", 1, 1.0, jobs, fleet_sim.collect_finals(client, keys, 1), [0.5])
    assert len(r_finals := fleet_sim.collect_finals(client, keys, 1)) == 2 and not r.answered_once
    assert sorted(len(f) for f in r_finals.values()) == [1, 2]


def test_prefetch_keeps_sixteen_jobs_in_hand_whatever_the_cache_holds():
    q = fleet_sim.PrefetchQueue(fleet_sim.PREFETCH, 100.0, in_flight={"a": 1, "b": 2})
    assert q.read_count(free_seqs=0, admissible_tokens=0, engine_idle=False) == 14


def test_capacity_estimate_grows_with_the_fleet_and_percentiles_pick_the_tail():
    mix = fleet_sim.JobMix()
    small, big = (fleet_capacity(fleet_sim.mixed_fleet(n), mix, 0.02, 0.0) for n in (4, 8))
    assert big > small > 0
    assert percentile(list(range(100)), 0.99) == 99 and percentile([], 0.5) == 0.0
    assert json.dumps({"ok": percentile([1.0], 0.5)})


def test_backlog_drain_by_worker_processes_answers_every_job_once_and_counts_redis_cpu():
    from kvgate.bench.fleet import run_throughput

    with fleet_sim.RedisProcess() as server:
        # 3,000 jobs: Redis spends ~70 ms of CPU on them, well above /proc's 10 ms tick (300 read as 0.0)
        r = run_throughput(server, _args(throughput_jobs=3000, procs=1))
    assert r["answered_once"] and r["jobs"] == 3000
    assert r["jobs_per_s"] > 0 and r["redis_cpu_s"] > 0 and r["worker_cpu_s"] > 0


def test_waiting_for_a_runs_answers_asks_after_a_bounded_number_of_jobs_a_poll(shared_redis, namespace):
    """The harness polls for answers in the process of the simulated workers it measures: asking after every job each
    poll (2,000 EXISTS every 100 ms) took a fifth of their GIL. A poll asks after at most POLL_JOBS of the oldest jobs
    not answered yet, and never again after one that was."""
    keys, client = Keys(namespace), shared_redis.client()
    jobs = fleet_sim.make_jobs(500, fleet_sim.JobMix(max_tokens=(2, 2)), seed=0, clients=1)
    answered = fleet_sim.Answered(client, keys, list(jobs))

    def exists_calls() -> int:
        return client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)

    def poll() -> tuple[int, int]:
        before = exists_calls()
        done = answered.poll()
        return done, exists_calls() - before

    assert poll() == (0, fleet_sim.Answered.POLL_JOBS)
    for job in jobs[:300] + jobs[450:]:  # results stored, as the publisher stores them
        client.set(keys.result(job.job_id), b"x")
    assert poll() == (200, 200)  # the first 200: all answered
    assert poll() == (300, 200)  # the next 100 answered, 100 not
    assert poll() == (350, 200)  # 100 asked again, 50 never asked yet answered
    for job in jobs[300:450]:
        client.set(keys.result(job.job_id), b"x")
    assert poll() == (500, 150)
    assert poll() == (500, 0)
