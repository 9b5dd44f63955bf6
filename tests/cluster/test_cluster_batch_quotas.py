"""A tenant's batch ceiling on a Redis Cluster (issue 45, break 5): its scripts touch shard 0's five keys only (one
slot), through the gateway's asyncio cluster client."""
from __future__ import annotations

import asyncio

from kvgate.gateway.batches.batch_quota import BatchQuota, batch_quota_keys
from kvgate.openai.batch import BatchRequest
from kvgate.producer import AsyncClient, Quota, Quotas
from kvgate.producer.shards import key_slot


def test_a_batch_ceiling_charges_renews_and_gives_back_in_one_slot_of_a_cluster(cluster, namespace):
    reqs = [BatchRequest(i, f"c-{i}", "/v1/completions", "m", [{"prompt": "x" * 40, "max_tokens": 10}] * 2)
            for i in range(3)]

    async def main():
        async with AsyncClient(cluster.url, namespace) as a:
            keys = batch_quota_keys(a.keys)
            assert len({key_slot(k.encode()) for k in keys}) == 1
            quota = BatchQuota(a.redis, a.keys, Quotas(default=Quota(batch_max_jobs=4)), lease_s=30)
            ceiling = quota.of("team-a", "batch_1")
            ceiling.estimate(reqs)
            admitted = [r.custom_id for r in await ceiling.admit(reqs)]
            held = await a.redis.zscore(keys[1], "team-a")
            members = await a.redis.zrange(keys[0], 0, -1)
            await a.redis.zadd(keys[0], {m: 1 for m in members})  # as if their leases were about to end
            ceiling.renewed_at -= quota.lease_s  # and a third of a lease had passed since the last renewal
            await ceiling.renew()
            renewed = [s > 1 for _, s in await a.redis.zrange(keys[0], 0, -1, withscores=True)]
            await ceiling.answered({"c-0": 15})
            await ceiling.end()
            return admitted, held, renewed, await a.redis.zcard(keys[0]), await a.redis.zscore(keys[1], "team-a")

    admitted, held, renewed, leases_left, jobs_left = asyncio.run(main())
    assert admitted == ["c-0", "c-1"] and held == 4  # the third line's 2 jobs would pass 4
    assert renewed == [True, True]
    assert (leases_left, jobs_left) == (0, None)
