"""Many hundreds of requests at the same moment through one gateway, half of them streamed: Redis is healthy, so
none may fail. The gateway's connection pool waits for a connection instead of raising, and every request reads the
one fleet snapshot instead of re-reading the fleet (issue 26.1)."""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from tests.gateway.conftest import stop_worker, wait_for_workers
from tests.support import spawn_worker

BURST = 600
POOL = 8  # a small pool, so the burst queues for connections many times over


@pytest.fixture(scope="module")
def wide_fleet(shared_redis):
    """One simulated worker that runs 128 jobs at a time, on a namespace of its own."""
    ns = f"burst{os.getpid()}-{abs(hash(time.monotonic())) % 10**6}"
    proc = spawn_worker(shared_redis.url, ns, "--simulated", "--sim-step-ms", "1", "--sim-per-token-ms", "0.01",
                        "--max-num-seqs", "128", worker_id="sim-burst")
    try:
        wait_for_workers(shared_redis.url, ns, proc=proc)
        yield shared_redis.url, ns
    finally:
        stop_worker(proc)


async def _one(http: httpx.AsyncClient, i: int, start: asyncio.Event) -> tuple[int, str]:
    """(status, what went wrong or ''): a streamed answer counts only when it ends in [DONE] with no error event."""
    body = {"model": "simulated", "messages": [{"role": "user", "content": f"burst {i}"}], "max_tokens": 2}
    await start.wait()
    if i % 2:
        r = await http.post("/chat/completions", json=body)
        return r.status_code, "" if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2 else r.text
    async with http.stream("POST", "/chat/completions", json=body | {"stream": True}) as r:
        raw = (await r.aread()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    if r.status_code != 200 or events[-1:] != ["[DONE]"] or any('"error"' in e for e in events):
        return r.status_code, raw[-300:]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1]) if c["choices"])
    return r.status_code, "" if text else raw[-300:]


async def _burst(base_url: str, n: int) -> list[tuple[int, str]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as http:
        start = asyncio.Event()
        tasks = [asyncio.create_task(_one(http, i, start)) for i in range(n)]
        await asyncio.sleep(0)  # every request is waiting on the start line
        start.set()
        return await asyncio.gather(*tasks)


def test_a_burst_of_600_simultaneous_requests_half_streamed_all_succeed(wide_fleet, gateway_factory):
    gw = gateway_factory(*wide_fleet, redis_pool_size=POOL)
    outcomes = asyncio.run(_burst(gw.base_url, BURST))
    failed = [(status, why) for status, why in outcomes if status != 200 or why]
    statuses = sorted({s for s, _ in failed})
    assert not failed, f"{len(failed)} of {BURST} failed, statuses {statuses}; first: {failed[0][1][:300]}"


def _calls(r, command: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_500_simultaneous_model_checks_read_the_fleet_once(redis_server):
    """The check every request makes reads one shared snapshot: one read of the fleet in flight, never one each."""
    import redis as sync_redis
    import redis.asyncio as aioredis

    from kvgate.gateway.models import LiveModels
    from kvgate.producer.keys import Keys

    keys = Keys("snap")
    admin = sync_redis.Redis.from_url(redis_server.url)
    admin.sadd(keys.models(), "known-model")

    async def burst() -> None:
        r = aioredis.Redis.from_url(redis_server.url)
        models = LiveModels(r, keys, cache_s=60.0)
        try:
            await asyncio.gather(*(models.check("known-model") for _ in range(500)))
        finally:
            await models.close()
            await r.aclose()

    before = _calls(admin, "smembers")
    asyncio.run(burst())
    assert _calls(admin, "smembers") - before == 1  # one read of {ns}:models, by one task


@pytest.mark.parametrize("kind", ["plain", "sentinel"])
def test_a_bounded_pool_makes_400_concurrent_commands_wait_for_its_4_connections(kind, request):
    """redis.asyncio's own pool raises MaxConnectionsError at its bound; the gateway's waits for a free connection,
    on a plain and on a Sentinel URL."""
    import redis as sync_redis

    from kvgate.producer.redis_url import connect_async

    server = request.getfixturevalue("redis_server" if kind == "plain" else "sentinel_group")
    url = server.url
    primary = server.url if kind == "plain" else server.primary.url

    async def many() -> list:
        r = connect_async(url, pool_size=4, pool_timeout_s=30)
        try:
            return await asyncio.gather(*(r.incr("n") for _ in range(400)), r.client_list())
        finally:
            await r.aclose()

    *counts, clients = asyncio.run(many())
    assert sorted(counts) == list(range(1, 401))
    assert sync_redis.Redis.from_url(primary).get("n") == b"400"
    ours = [c for c in clients if c["flags"] == "N" and not c.get("name", "").startswith("sentinel")]
    assert len(ours) <= 4  # sentinels and the replica link aside, the pool's connections


def test_a_burst_over_max_backlog_admits_at_most_the_limit_and_refuses_the_rest_with_429(redis_server,
                                                                                         gateway_factory):
    """No worker serves `parked` (the operator allowed it), so nothing drains: of 200 simultaneous requests at most
    --max-backlog may be enqueued, every other one is the documented 429 with Retry-After, and nothing else."""
    import redis as sync_redis

    from kvgate.producer.keys import Keys

    limit, n = 50, 200
    gw = gateway_factory(redis_server.url, "parked-ns", max_backlog=limit, retry_after_s=2, request_timeout_s=1,
                         models=("parked",))

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=gw.base_url, limits=limits, timeout=60) as http:
            start = asyncio.Event()

            async def one(i: int) -> httpx.Response:
                await start.wait()
                return await http.post("/completions", json={"model": "parked", "prompt": f"p{i}", "max_tokens": 1})

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            await asyncio.sleep(0)
            start.set()
            return await asyncio.gather(*tasks)

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code == 429]
    r = sync_redis.Redis.from_url(redis_server.url)
    enqueued = sum(r.xlen(stream) for stream in Keys("parked-ns").all_jobs("parked"))
    assert set(statuses) <= {429, 504}, sorted(set(statuses))  # 504: an admitted job nobody serves, at the timeout
    assert 0 < enqueued <= limit, f"{enqueued} jobs enqueued past --max-backlog {limit}; statuses {statuses.count(429)} x 429"
    assert len(refused) == n - enqueued
    assert all(r.headers["retry-after"] == "2" and r.json()["error"]["code"] == "queue_full" for r in refused)
