"""A tenant's managed batches under one ceiling of their own (issue 45, break 5): however many batches a tenant
starts, on whichever replica, its batch jobs in flight and its batch tokens per minute are counted together in Redis
against `batch_max_jobs` and `batch_tokens_per_minute` (by default its `max_jobs` and `tokens_per_minute`), given back
as lines are answered, and when a batch is cancelled or expires. Its interactive requests keep their own quota."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis

from kvgate.gateway.batches.batch_quota import BatchQuota, batch_quota_keys
from kvgate.openai.batch import BatchRequest
from kvgate.producer.keys import Keys
from kvgate.producer.quotas import Quota, Quotas
from kvgate.producer.queue_stats import read_queue_stats
from tests.gateway.batch_files import jsonl, request, rows_of, wait_final
from tests.gateway.conftest import SIM, stop_worker, wait_for_workers
from tests.support import spawn_worker, wait_for

KEYS = ["sk-a=team-a", "sk-b=team-b"]
CHAT = "/v1/chat/completions"


def quotas_file(tmp_path, monkeypatch, text: str) -> None:
    path = tmp_path / "quotas.toml"
    path.write_text(text)
    monkeypatch.setenv("KVGATE_QUOTAS_FILE", str(path))


def replicas(shared_redis, namespace, gateway_factory, tmp_path, n: int = 1, **settings):
    """`n` gateways on one namespace and one file store (a batch may be driven by any of them)."""
    files = tmp_path / "files"
    return [gateway_factory(shared_redis.url, namespace, api_keys=KEYS, models=["simulated"], batch_poll_s=0.2,
                            files_dir=str(files), **settings) for _ in range(n)]


def start_batch(c: openai.OpenAI, rows: list[dict]):
    f = c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")


def batch_jobs_in_fleet(r: redis.Redis, keys: Keys) -> int:
    """What the fleet holds of the batch queue (`low`): queued, or read by a worker and not yet final."""
    low = read_queue_stats(r, keys).priorities["low"]
    return low.backlog + low.pending


def interactive_in_fleet(r: redis.Redis, keys: Keys) -> int:
    normal = read_queue_stats(r, keys).priorities["normal"]
    return normal.backlog + normal.pending


def ceiling_counts(r: redis.Redis, keys: Keys, tenant: str) -> tuple[int, int, int]:
    """The batch ceiling's own count of the tenant's jobs in flight, its leases, and its tokens over this minute and
    the last (whole: a test spans at most one turn of the minute)."""
    leases, jobs, tokens, prev, _ = batch_quota_keys(keys)
    held = sum(1 for m in r.zrange(leases, 0, -1) if m.decode().startswith(f"{tenant}|"))
    charged = int(float(r.zscore(tokens, tenant) or 0) + float(r.zscore(prev, tenant) or 0))
    return int(float(r.zscore(jobs, tenant) or 0)), held, charged


def sampling(r: redis.Redis, keys: Keys):
    """A thread that samples the fleet's batch jobs until the returned event is set."""
    samples, stop = [], threading.Event()

    def run():
        while not stop.wait(0.01):
            samples.append(batch_jobs_in_fleet(r, keys))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return samples, stop, thread


def test_three_batches_of_a_tenant_limited_to_5_jobs_never_hold_more_than_5_and_their_tokens_count(
        shared_redis, namespace, gateway_factory, tmp_path, monkeypatch):
    quotas_file(tmp_path, monkeypatch, "[tenants.team-a]\nmax_jobs = 5\n")
    gws = replicas(shared_redis, namespace, gateway_factory, tmp_path, n=2, batch_window=64)
    keys, r = Keys(namespace), redis.Redis.from_url(shared_redis.url)
    a = openai.OpenAI(base_url=gws[0].base_url, api_key="sk-a", max_retries=0, timeout=60)
    batches = [start_batch(a, [request(64 * k + i) for i in range(64)]) for k in range(3)]
    # no worker yet: every job the three batches submit waits in the queue, so the queue shows all they may hold
    wait_for(lambda: batch_jobs_in_fleet(r, keys) >= 5, 30, "the batches' first jobs queued")
    wait_for(lambda: all(a.batches.retrieve(b.id).status == "in_progress" for b in batches), 30, "all three running")
    queued = batch_jobs_in_fleet(r, keys)
    assert queued <= 5, f"{queued} batch jobs of team-a in flight, over its 5"
    jobs, held, tokens = ceiling_counts(r, keys, "team-a")
    assert (jobs, held) == (5, 5) and tokens > 0

    # its interactive requests are not starved by its batches: their quota is their own
    answer: dict = {}
    chat = threading.Thread(target=lambda: answer.update(response=httpx.post(
        f"{gws[1].base_url}/chat/completions", headers={"Authorization": "Bearer sk-a"}, timeout=60,
        json={"model": "simulated", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})), daemon=True)
    chat.start()
    wait_for(lambda: interactive_in_fleet(r, keys) == 1, 30, "team-a's interactive request queued")

    samples, stop, sampler = sampling(r, keys)
    proc = spawn_worker(shared_redis.url, namespace, *SIM, worker_id="sim-batch-quota")
    try:
        wait_for_workers(shared_redis.url, namespace, proc=proc)
        chat.join(60)
        done = [wait_final(a.batches.retrieve, b.id, timeout=180) for b in batches]
    finally:
        stop.set()
        sampler.join(5)
        stop_worker(proc)
    assert answer["response"].status_code == 200, answer["response"].text
    assert [(d.status, d.request_counts.completed) for d in done] == [("completed", 64)] * 3
    assert samples and max(samples) <= 5, max(samples)
    usage = sum(row["response"]["body"]["usage"]["total_tokens"] for d in done
                for row in rows_of(a.files.content(d.output_file_id).content))
    # every slot given back, and the tokens charged are what the jobs used (estimates corrected as lines answer)
    assert ceiling_counts(r, keys, "team-a") == (0, 0, usage)
    a.close()
    r.close()


def test_a_batch_waits_at_its_tenants_tokens_per_minute_and_an_expired_batch_gives_its_slots_back(
        shared_redis, namespace, gateway_factory, tmp_path, monkeypatch):
    # each line is charged 3 (a 10 or 11 character prompt / 4, rounded up) + 100 max_tokens = 103 when submitted
    quotas_file(tmp_path, monkeypatch, "[tenants.team-a]\ntokens_per_minute = 350\n")
    (gw,) = replicas(shared_redis, namespace, gateway_factory, tmp_path)
    keys, r = Keys(namespace), redis.Redis.from_url(shared_redis.url)
    with openai.OpenAI(base_url=gw.base_url, api_key="sk-a", max_retries=0, timeout=60) as a:
        batch = start_batch(a, [request(i, max_tokens=100) for i in range(20)])
        wait_for(lambda: batch_jobs_in_fleet(r, keys) >= 3, 30, "the batch's first jobs queued")
        assert batch_jobs_in_fleet(r, keys) == 3  # a fourth line's 103 tokens would pass 350
        assert ceiling_counts(r, keys, "team-a") == (3, 3, 309)
        r.hset(f"{keys.prefix}:batch:{batch.id}", "expires_at", int(time.time()) - 1)  # as if 24 hours had passed
        done = wait_final(a.batches.retrieve, batch.id)
    assert done.status == "expired" and done.request_counts.failed == 20
    # the slots come back; the tokens stay charged at the estimate (the jobs may have run: nobody waits to know)
    assert ceiling_counts(r, keys, "team-a") == (0, 0, 309)
    r.close()


def test_batch_max_jobs_in_the_quotas_file_sets_the_batch_ceiling_and_a_cancel_gives_its_slots_back(
        shared_redis, namespace, gateway_factory, tmp_path, monkeypatch):
    quotas_file(tmp_path, monkeypatch, "[default]\nmax_jobs = 10\nbatch_max_jobs = 2\n")
    gws = replicas(shared_redis, namespace, gateway_factory, tmp_path, n=2, batch_window=64)
    keys, r = Keys(namespace), redis.Redis.from_url(shared_redis.url)
    with openai.OpenAI(base_url=gws[0].base_url, api_key="sk-b", max_retries=0, timeout=60) as b:
        batches = [start_batch(b, [request(i) for i in range(10)]) for _ in range(2)]
        wait_for(lambda: batch_jobs_in_fleet(r, keys) >= 2, 30, "the batches' first jobs queued")
        wait_for(lambda: all(b.batches.retrieve(x.id).status == "in_progress" for x in batches), 30, "both running")
        assert batch_jobs_in_fleet(r, keys) == 2
        assert ceiling_counts(r, keys, "team-b")[:2] == (2, 2)
        done = [wait_final(b.batches.retrieve, b.batches.cancel(x.id).id) for x in batches]
    assert [d.status for d in done] == ["cancelled", "cancelled"]
    assert ceiling_counts(r, keys, "team-b")[:2] == (0, 0)
    r.close()


@pytest.mark.parametrize("text, named", [
    ("[default]\nbatch_max_jobs = 0\n", ["default.batch_max_jobs: Input should be greater than or equal to 1",
                                          "(got 0)"]),
    ('[tenants.team-a]\nbatch_tokens_per_minute = "lots"\n',
     ["tenants.team-a.batch_tokens_per_minute: Input should be a valid integer", "(got 'lots')"]),
])
def test_a_bad_batch_ceiling_in_the_quotas_file_stops_the_start_naming_the_key_and_value(tmp_path, text, named):
    from kvgate.gateway import GatewaySettings

    bad = tmp_path / "quotas.toml"
    bad.write_text(text)
    with pytest.raises(ValueError) as e:
        GatewaySettings(quotas_file=str(bad))
    assert all(part in str(e.value) for part in [str(bad), *named]), str(e.value)


# -- the ceiling's scripts, against a real Redis --------------------------------------------------------------------
def lines(*jobs_per_line: int, batch: str = "b") -> list:
    """Lines of `n` jobs each (an /v1/embeddings line of n inputs), each job estimated at 10 + 10 = 20 tokens."""
    return [BatchRequest(i, f"{batch}-{i}", "/v1/embeddings", "m", [{"prompt": "x" * 40, "max_tokens": 10}] * n)
            for i, n in enumerate(jobs_per_line)]


def ceilings(redis_url: str, namespace: str, **default):
    """A BatchQuota with `default` the quota of every tenant, on an asyncio client (closed by the caller)."""
    r = aioredis.Redis.from_url(redis_url)
    return r, BatchQuota(r, Keys(namespace), Quotas(default=Quota(**default)), lease_s=30.0)


def ids(reqs) -> list[str]:
    return [req.custom_id for req in reqs]


def test_the_ceiling_admits_lines_in_order_and_a_line_over_it_goes_alone(redis_url, namespace):
    async def main():
        r, quota = ceilings(redis_url, namespace, batch_max_jobs=4)
        one, two = quota.of("t", "b1"), quota.of("t", "b2")
        first, second = lines(3, 2, 1, batch="one"), lines(6, batch="two")
        for c, reqs in ((one, first), (two, second)):
            c.estimate(reqs)
        # 3 fit; 2 more would pass 4, and the 1 after it does not overtake it
        assert ids(await one.admit(first)) == ["one-0"]
        assert ids(await two.admit(second)) == []  # 6 jobs, more than the whole ceiling: only once none are in flight
        await one.answered({"one-0": 5})
        assert ids(await two.admit(second)) == ["two-0"]  # alone
        assert ids(await one.admit(first[1:])) == []
        await two.end()
        assert ids(await one.admit(first[1:])) == ["one-1", "one-2"]
        await one.end()
        await r.aclose()

    asyncio.run(main())
    with redis.Redis.from_url(redis_url) as r:
        assert ceiling_counts(r, Keys(namespace), "t")[:2] == (0, 0)


def test_a_line_still_charged_is_adopted_by_a_resumed_run_not_counted_twice(redis_url, namespace):
    async def main():
        r, quota = ceilings(redis_url, namespace, batch_max_jobs=3, batch_tokens_per_minute=1000)
        died, resumed = quota.of("t", "b"), quota.of("t", "b")  # one batch, driven by a replica that died, then another
        reqs = lines(2, 1)
        died.estimate(reqs)
        resumed.estimate(reqs)
        assert ids(await died.admit(reqs)) == ["b-0", "b-1"]
        assert ids(await resumed.admit(reqs)) == ["b-0", "b-1"]  # adopted: the lines' jobs are reattached
        with redis.Redis.from_url(redis_url) as sync:
            assert ceiling_counts(sync, Keys(namespace), "t") == (3, 2, 60)
        await resumed.answered({"b-0": 30, "b-1": 20})  # given back once; adopted charges leave the tokens as charged
        await r.aclose()

    asyncio.run(main())
    with redis.Redis.from_url(redis_url) as r:
        assert ceiling_counts(r, Keys(namespace), "t") == (0, 0, 60)


def test_a_line_whose_replica_died_is_given_back_when_its_lease_ends_and_any_tenant_admits(redis_url, namespace):
    async def main():
        r, quota = ceilings(redis_url, namespace, batch_max_jobs=3)
        gone = quota.of("t", "b")
        gone.estimate(lines(3))
        assert ids(await gone.admit(lines(3))) == ["b-0"]
        leases = batch_quota_keys(Keys(namespace))[0]
        await r.zadd(leases, {m: 0 for m in await r.zrange(leases, 0, -1)})  # as if its lease had run out unrenewed
        other = quota.of("u", "c")
        other.estimate(lines(1, batch="c"))
        assert ids(await other.admit(lines(1, batch="c"))) == ["c-0"]  # prunes t's line, all 3 of its jobs
        with redis.Redis.from_url(redis_url) as sync:
            assert ceiling_counts(sync, Keys(namespace), "t")[:2] == (0, 0)
        await gone.answered({"b-0": 20})  # the late answer gives back nothing twice
        await other.end()
        await r.aclose()

    asyncio.run(main())
    with redis.Redis.from_url(redis_url) as r:
        keys = Keys(namespace)
        assert [ceiling_counts(r, keys, t)[:2] for t in ("t", "u")] == [(0, 0), (0, 0)]
        assert int(r.hget(batch_quota_keys(keys)[4], "jobs")) == 0


def test_a_tenants_batch_ceiling_is_its_own_or_else_its_interactive_numbers():
    quotas = Quotas(default=Quota(max_jobs=5, tokens_per_minute=1000),
                    tenants={"big": Quota(max_jobs=5, batch_max_jobs=50, batch_tokens_per_minute=9000)})
    assert quotas.of("any").batch == Quota(max_jobs=5, tokens_per_minute=1000)  # unset: the interactive numbers
    assert quotas.of("big").batch == Quota(max_jobs=50, tokens_per_minute=9000)
    assert not Quotas(default=Quota(batch_max_jobs=1)).unlimited  # a batch ceiling alone turns quotas on
