"""The bare Redis loop that W-FLEET compares kvgate with does a worker's Redis work for every job."""
from __future__ import annotations

import redis

from kvgate.bench.bare_loop import run_bare_loop
from kvgate.bench.fleet_sim import RedisProcess


def test_bare_loop_stores_a_result_replies_and_acks_every_job():
    with RedisProcess() as server:
        out = run_bare_loop(server, [b"job-%d" % i for i in range(300)], b"result", procs=2)
        r = redis.Redis.from_url(server.url)
        results = list(r.scan_iter("bare:result:*", count=1000))
        replies = sum(r.xlen(key) for key in r.scan_iter("bare:reply:*"))
    assert out["all_acked"] and out["jobs"] == 300 and out["jobs_per_s"] > 0
    assert len(results) == 300 and replies == 300
    assert out["redis_cpu_s"] >= 0 and out["jobs_per_redis_cpu_s"] > 0
