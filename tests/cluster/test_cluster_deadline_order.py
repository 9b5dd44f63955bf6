"""Deadline order on a Redis Cluster (worker/due.py): a stream's due index lives in its shard's slot, so the read
script parks and claims there; each shard's jobs are read earliest deadline first, and a parked job's status is
queued."""
from __future__ import annotations

import random

from kvgate.producer import Client
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import decode_job
from kvgate.producer.redis_url import connect, keys_for


def test_each_shard_reads_its_jobs_earliest_deadline_first(cluster, namespace):
    from kvgate.worker.reader import Reader, ReadPlan

    r = connect(cluster.url)
    with Client(cluster.url, namespace) as client:
        keys = keys_for(cluster.url, r, namespace)
        ttls = random.Random(4).sample(range(60, 3600), 40)
        handles = {ttl: client.submit(prompt=f"due in {ttl}", ttl_s=ttl) for ttl in ttls}
        bands = keys.job_streams(None, "normal")
        # a window wider than any shard's share of the 40 jobs: each stream's order is then wholly its deadlines' (with
        # a narrower one the first read picks among its window only, and a later-due job can lead: the test was flaky)
        reader = Reader(r, "w1", ReadPlan(bands), keys=keys, deadline_window=64)
        first = reader.read(1)
        assert any(r.zcard(keys.due_index(band)) for band in bands)  # parked in the stream's own shard
        assert {h.status().state for h in handles.values()} <= {"queued", "running"}
        got = first + reader.read(100)
    ttl_of = {h.job_id: ttl for ttl, h in handles.items()}
    for band in bands:
        ttls = [ttl_of[decode_job(e.fields[b"p"]).job_id] for e in got if e.stream == band]
        assert ttls == sorted(ttls), f"{band}: read in the order {ttls}"
    assert sorted(ttl_of[decode_job(e.fields[b"p"]).job_id] for e in got) == sorted(handles)
    assert all(r.zcard(keys.due_index(band)) == 0 for band in bands) and all(e.deliveries == 1 for e in got)
    assert Keys.PARKED not in {c["name"] for band in bands for c in r.xinfo_consumers(band, Keys.GROUP)
                               if c["pending"]}
