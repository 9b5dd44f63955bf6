"""One admission is whole on a Redis Cluster too (issue 45.4): its jobs are one MULTI per shard, and when a later
shard refuses (out of memory here), the jobs the earlier shards took are taken back, so the caller's error is true:
nothing of the call is queued, and a resubmit enqueues each job once."""
from __future__ import annotations

import pytest

from kvgate.producer import Client, ServerRefused
from kvgate.producer.redis_url import connect, keys_for


def queued(cluster, ns: str) -> int:
    r = connect(cluster.url)
    keys = keys_for(cluster.url, r, ns)
    return sum(r.xlen(s) for s in keys.all_jobs(None))


def test_a_later_shards_refusal_takes_back_the_jobs_the_earlier_shards_took(cluster, namespace):
    with Client(cluster.url, namespace) as client:
        keys = client.keys
        first = cluster.node_of(keys.jobs(None, "normal", shard=0))  # shard 0 is sent first: it takes its jobs
        full = next(n for n in cluster.primary_nodes() if n.port != first.port)
        r = full.client()
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", r.info("memory")["used_memory"])
        try:
            requests = [{"prompt": f"job {i}", "max_tokens": 4} for i in range(60)]
            with pytest.raises(ServerRefused):
                client.submit_many(requests, chunk_size=None)
            assert queued(cluster, namespace) == 0  # before: shard 0's (and any other taken shard's) jobs stayed
        finally:
            r.config_set("maxmemory", 0)
        handles = client.submit_many(requests, chunk_size=None)
        assert len({h.job_id for h in handles}) == 60 and queued(cluster, namespace) == 60
