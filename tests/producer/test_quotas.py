"""Per-tenant quotas in the SDK (issue 27): Client(tenant=..., quota=...) refuses over its tenant's ceiling with
QuotaExceeded, counts in Redis what every client of the namespace shares, and gives slots back as jobs settle."""
from __future__ import annotations

import time

import pytest
import redis

from kvgate.producer import Backpressure, Client, InvalidRequest, Quota, QuotaExceeded, Quotas
from kvgate.producer.keys import Keys
from kvgate.producer.queue_stats import read_queue_stats
from kvgate.producer.quotas import TAKE, quota_keys


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.02)
    return value


def in_flight(r: redis.Redis, keys: Keys, tenant: str) -> int:
    return int(float(r.zscore(keys.quota_jobs(), tenant) or 0))


def test_a_tenant_over_max_jobs_is_refused_and_another_tenant_is_not_and_slots_come_back(
        redis_url, namespace, worker):
    worker.ensure_groups()
    r, keys = worker.r, worker.keys
    with Client(redis_url, namespace, tenant="team-a", quota=Quota(max_jobs=2)) as a, \
            Client(redis_url, namespace, tenant="team-b", quota=Quota(max_jobs=2)) as b:
        first = [a.submit("one"), a.submit("two")]
        with pytest.raises(QuotaExceeded) as refused:
            a.submit("three")
        e = refused.value
        assert isinstance(e, Backpressure)
        assert (e.tenant, e.ceiling, e.limit, e.used, e.retry_after_s) == ("team-a", "max_jobs", 2, 2, 1.0)
        assert "tenant 'team-a'" in str(e) and "max_jobs=2" in str(e) and "retry after 1 s" in str(e)
        assert len(b.submit_many([{"prompt": "b1"}, {"prompt": "b2"}])) == 2  # team-b has its own two
        with pytest.raises(InvalidRequest, match="over its whole max_jobs=2, so no wait can admit them"):
            b.submit_many([{"prompt": "b"}] * 3)
        assert worker.r.xlen(keys.jobs(None, "normal")) == 4  # the refused job was never enqueued

        jobs = worker.take(count=10)
        for job in jobs:  # one ends done, the others cancelled: every slot comes back
            worker.final(job, "done" if job.job_id == first[0].job_id else "cancelled", token_ids=[1, 2])
        assert first[0].result(timeout=10).status == "done"
        wait_until(lambda: r.zcard(keys.quota_jobs()) == 0 and r.zcard(keys.quota_leases()) == 0, 10,
                   "slots given back")
        assert int(r.hget(keys.quota_window(), "jobs")) == 0
        a.submit("again")
        assert in_flight(r, keys, "team-a") == 1


def test_tokens_per_minute_charges_an_estimate_at_admission_and_corrects_it_when_the_job_finishes(
        redis_url, namespace, worker):
    worker.ensure_groups()
    r, keys = worker.r, worker.keys
    with Client(redis_url, namespace, tenant="team-a", quota=Quota(tokens_per_minute=300)) as a:
        a.submit("hello", max_tokens=250)  # estimated: ceil(5 / 4) + 250 = 252
        assert int(float(r.zscore(keys.quota_tokens(), "team-a"))) == 252
        with pytest.raises(QuotaExceeded) as refused:
            a.submit("hello", max_tokens=100)
        assert (refused.value.ceiling, refused.value.limit) == ("tokens_per_minute", 300)
        assert 1 <= refused.value.retry_after_s <= 60
        job, = worker.take()
        worker.final(job, token_ids=[1, 2, 3, 4, 5])  # usage: 3 prompt + 5 generated = 8
        wait_until(lambda: int(float(r.zscore(keys.quota_tokens(), "team-a") or 0)) <= 8, 10, "the correction")
        a.submit("hello", max_tokens=100)  # 8 + 102 fits now


def test_one_call_with_jobs_of_two_tenants_is_admitted_all_or_none(redis_url, namespace, worker):
    worker.ensure_groups()
    r, keys = worker.r, worker.keys
    quotas = Quotas(default=Quota(max_jobs=5), tenants={"small": Quota(max_jobs=1)})
    with Client(redis_url, namespace, quota=quotas) as c:
        with pytest.raises(InvalidRequest, match="over its whole max_jobs=1"):  # more than small's whole quota
            c.submit_many([{"prompt": "x", "tenant": "big"}, {"prompt": "y", "tenant": "small"},
                           {"prompt": "z", "tenant": "small"}])
        c.submit("held", tenant="small")
        with pytest.raises(QuotaExceeded, match="tenant 'small'"):  # small is full: big, charged first, is not let in
            c.submit_many([{"prompt": "x", "tenant": "big"}, {"prompt": "y", "tenant": "small"}])
        assert r.xlen(keys.jobs(None, "normal")) == 1
        wait_until(lambda: in_flight(r, keys, "big") == 0, 10, "big's charge given back")
        c.submit("no tenant: counted as default")
        assert in_flight(r, keys, "default") == 1


def test_a_slot_whose_producer_went_away_is_freed_when_its_lease_ends(redis_url, namespace, worker):
    worker.ensure_groups()
    r, keys = worker.r, worker.keys
    gone = Client(redis_url, namespace, tenant="team-a", quota=Quota(max_jobs=1), quota_lease_s=0.5)
    gone.submit("held")
    gone.close()  # as a gateway that died: nobody will give its slot back
    with Client(redis_url, namespace, tenant="team-a", quota=Quota(max_jobs=1)) as c:
        with pytest.raises(QuotaExceeded):
            c.submit("refused while the lease runs")
        time.sleep(0.6)
        c.submit("admitted once the lease ended")  # the admission pruned the expired lease
    assert in_flight(r, keys, "team-a") == 1


def test_hostile_tenant_names_are_refused_before_anything_is_counted(redis_url, namespace, worker):
    r, keys = worker.r, worker.keys
    for name in ["a|b", "x" * 65, "{slot}", "", "team a", "../etc"]:
        with pytest.raises(ValueError):
            Client(redis_url, namespace, tenant=name, quota=Quota(max_jobs=1))
    with Client(redis_url, namespace, quota=Quota(max_jobs=1)) as c:
        with pytest.raises(InvalidRequest, match="tenant"):
            c.submit("hi", tenant="a|b")
    with pytest.raises(ValueError, match="must be 1 to 64"):
        Quotas(tenants={"a|b": Quota(max_jobs=1)})
    assert not r.exists(*quota_keys(keys))


def test_stats_name_the_busiest_tenants_and_sum_the_rest_whatever_their_number(redis_server, namespace):
    r, keys = redis_server.client(), Keys(namespace)
    tenants = 100_000
    for start in range(0, tenants, 20_000):  # 100,000 tenants with a job each, as the admission script leaves them
        chunk = range(start, start + 20_000)
        r.zadd(keys.quota_leases(), {f"t{i}|job{i}": 2**50 for i in chunk})
        r.zadd(keys.quota_jobs(), {f"t{i}": 1 for i in chunk})
    r.hset(keys.quota_window(), "jobs", tenants)
    r.register_script(TAKE)(keys=quota_keys(keys), args=["busy", -1, -1, 10, 600_000, "b1", "b2", "b3"])

    stats = read_queue_stats(r, keys)
    top, other = stats.tenants.top, stats.tenants.other
    assert len(top) == 10 and top[0].tenant == "busy" and top[0].jobs == 3
    assert sum(u.jobs for u in top) + other.jobs == tenants + 3
    assert stats.to_dict()["tenants"]["other"]["jobs"] == other.jobs
    assert len(str(stats.to_dict()["tenants"])) < 2_000  # what stats carry stays small

    with Client(redis_server.url, namespace, tenant="t5", quota=Quota(max_jobs=2)) as c:  # admission: O(log n)
        c.submit("second of t5")
        with pytest.raises(QuotaExceeded):
            c.submit("third of t5")
    r.close()
