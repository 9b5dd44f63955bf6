"""What a worker publishes per tenant in its heartbeat (worker/tenant_load.py): jobs running, tokens served and the
queue wait of jobs admitted over the last minute, bounded however many tenants producers invent; and a real worker's
figures as `kvgate stats` reads them."""
from __future__ import annotations

from kvgate import Client
from kvgate.producer.keys import QUEUE_WAIT_BUCKETS
from kvgate.producer.limits import OTHER_TENANTS, TOP_TENANTS
from kvgate.producer.queue_stats import read_queue_stats
from kvgate.worker.tenant_load import SLOT_TENANTS, TenantLoad
from tests.support import wait_for


def test_a_snapshot_counts_running_tokens_and_waits_over_the_last_minute_only():
    load = TenantLoad()
    load.admitted("a", 0.003, now=100.0)  # in the bucket up to 0.005 s
    load.finished("a", 50, now=100.0)
    load.admitted(None, 20.0, now=150.0)  # no tenant: `default`, as quotas and fair share count it
    load.finished("a", 7, now=155.0)
    snap = load.snapshot(["a", "a", None], now=159.0)
    assert snap["a"][:2] == [2, 57] and snap["a"][2 + QUEUE_WAIT_BUCKETS.index(0.005)] == 1
    assert snap["default"][0] == 1 and snap["default"][2 + QUEUE_WAIT_BUCKETS.index(30.0)] == 1
    later = load.snapshot([], now=165.0)  # 100 s's slot has left the minute
    assert later["a"][:2] == [0, 7] and sum(later["a"][2:]) == 0


def test_a_snapshot_names_the_busiest_ten_and_sums_the_rest_and_a_slot_names_a_bounded_number():
    load = TenantLoad()
    for i in range(100_000):  # a hostile producer's distinct tenants, all in one slot
        load.admitted(f"t{i}", 0.1, now=10.0)
    assert len(load.slots[-1][1]) == SLOT_TENANTS + 1  # the rest counted under `_other`
    snap = load.snapshot([f"t{i}" for i in range(30)], now=11.0)
    assert len(snap) == TOP_TENANTS + 1 and all(r[0] == 1 for t, r in snap.items() if t != OTHER_TENANTS)
    assert snap[OTHER_TENANTS][0] == 20 and sum(sum(r[2:]) for r in snap.values()) == 100_000


def test_a_workers_heartbeat_shows_each_tenants_running_jobs_tokens_and_queue_wait(queue, thread_worker):
    queue.r.sadd(queue.keys.models(), "default")
    with Client(queue.server.url, queue.ns, tenant="acme") as acme, \
            Client(queue.server.url, queue.ns, tenant="beta") as beta, \
            thread_worker(heartbeat_interval_s=0.1, max_num_seqs=4):
        long_ = acme.submit("x", max_tokens=4000, ignore_eos=True)

        def running() -> dict:
            view = read_queue_stats(queue.r, queue.keys).tenant_view
            return {t.tenant: t.running for t in view.top}

        wait_for(lambda: running().get("acme") == 1, 30, "acme's job running in the heartbeat")
        short = beta.submit_many([{"prompt": "y", "max_tokens": 5, "ignore_eos": True}] * 3, progress=False)
        for h in short:
            assert h.result(timeout=30).status == "done"

        def beta_view():
            return next((t for t in read_queue_stats(queue.r, queue.keys).tenant_view.top if t.tenant == "beta"),
                        None)

        wait_for(lambda: beta_view() is not None and sum(beta_view().waits) == 3 and beta_view().tokens > 0, 30,
                 "beta's three jobs counted")
        got = beta_view()
        assert got.running == 0 and got.tokens >= 3 * 5 and got.wait_quantile(0.99) is not None
        acme.cancel(long_.job_id)
