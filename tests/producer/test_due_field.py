"""A job with a deadline carries its relative deadline in ms (the stream field `d`) beside its payload, on every
enqueue path (plain, idempotency claim, fair share), which the workers' read script orders by (worker/due.py); stats
count jobs parked for deadline order as waiting, and a parked job's status is queued."""
from __future__ import annotations

import pytest

from kvgate.producer import Client
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import DUE_FIELD, decode_job
from kvgate.producer.queue_stats import read_queue_stats
from kvgate.worker.reader import Reader, ReadPlan


def fields_of(r, stream: str) -> list[dict]:
    return [{k.decode(): v for k, v in f.items()} for _, f in r.xrange(stream)]


@pytest.mark.parametrize("path", ["plain", "idempotency", "fair"])
def test_the_relative_deadline_goes_in_the_entry_on_every_enqueue_path(redis_server, namespace, path):
    r, keys = redis_server.client(), Keys(namespace)
    if path == "fair":
        r.set(keys.fair(), 1)
    extra = {"idempotency_key": "k1"} if path == "idempotency" else {}
    with Client(redis_server.url, namespace, tenant="acme") as client:
        client.submit(prompt="x", ttl_s=600, **extra)
        client.submit(prompt="y", **({"idempotency_key": "k2"} if extra else {}))
    stream = keys.jobs(None, "normal")
    rows = fields_of(r, Keys.tenant_jobs(stream, "acme") if path == "fair" else stream)
    assert [sorted(row) for row in rows] == [["d", "p"], ["p"]]
    job = decode_job(rows[0]["p"])
    assert int(rows[0][DUE_FIELD]) == round((job.deadline - job.enqueued_at) * 1000) == 600_000


def test_parked_jobs_count_as_backlog_and_their_status_is_queued(redis_server, namespace):
    r, keys = redis_server.client(), Keys(namespace)
    with Client(redis_server.url, namespace) as client:
        handles = [client.submit(prompt=f"job {i}", ttl_s=600 + i) for i in range(5)]
        stream = keys.jobs(None, "normal")
        Reader(r, "w1", ReadPlan([stream]), keys=keys, deadline_window=3).read(1)
        assert r.zcard(keys.due_index(stream)) == 3
        normal = read_queue_stats(r, keys).models["default"].priorities["normal"]
        assert (normal.backlog, normal.pending) == (4, 1)  # 3 parked + 1 never read; 1 running
        assert [h.status().state for h in handles] == ["running", "queued", "queued", "queued", "queued"]
        assert client.status(handles[1].job_id).state == "queued"  # a bare id: among the pending, parked
