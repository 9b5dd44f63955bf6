"""Tenant quotas on a Redis Cluster (issue 27): the quota scripts touch shard 0's keys only (one slot), while the jobs
they admit spread over every shard; slots come back from the reply readers of every shard."""
from __future__ import annotations

import asyncio

import pytest

from kvgate.producer import AsyncClient, Client, Quota, QuotaExceeded
from kvgate.producer.redis_url import connect, keys_for
from kvgate.producer.quotas import quota_keys
from kvgate.producer.shards import key_slot
from tests.cluster.test_cluster_queue import workers
from tests.reliability.chaos_harness import stop_all
from tests.support import wait_for


def test_quotas_count_jobs_of_every_shard_in_one_slot_and_give_every_slot_back(cluster, namespace):
    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, namespace)
    assert len({key_slot(k.encode()) for k in quota_keys(keys)}) == 1
    with Client(cluster.url, namespace, tenant="team-a", quota=Quota(max_jobs=24)) as c:
        handles = c.submit_many([dict(prompt=f"job {i}", max_tokens=4) for i in range(24)])
        assert len({keys.shard_of(h.job_id) for h in handles}) > 1
        with pytest.raises(QuotaExceeded, match="max_jobs=24"):
            c.submit("the 25th")
        assert c.stats().tenants.top[0].jobs == 24

        async def other_tenant():  # the AsyncClient, on the cluster, is not held back by team-a
            async with AsyncClient(cluster.url, namespace, tenant="team-b", quota=Quota(max_jobs=2)) as a:
                return await (await a.submit("b", max_tokens=4)).result(timeout=60)

        procs = workers(cluster, namespace, 1)
        try:
            assert asyncio.run(other_tenant()).status == "done"
            assert [h.result(timeout=60).status for h in handles] == ["done"] * 24
            wait_for(lambda: r.zcard(keys.quota_jobs()) == 0 and r.zcard(keys.quota_leases()) == 0, 30,
                     "every slot given back")
            c.submit("admitted again", max_tokens=4).result(timeout=60)
        finally:
            stop_all(procs)
    r.close()
