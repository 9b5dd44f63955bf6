"""The SDK against a real redis-server that is out of memory (maxmemory with noeviction).

Redis refuses every write that needs memory. The SDK must say so with a typed error and a clear message (not
redis-py's, which quotes the refused command with the payload bytes), enqueue all of a batch or none of it,
and still start a client whose job groups exist."""
from __future__ import annotations

import asyncio

import pytest

from kvgate.producer import AsyncClient, Client, ServerRefused
from kvgate.producer.keys import Keys
from tests.conftest import RedisServer
from tests.support import wait_for

SECRET = "confidential-prompt-text"


@pytest.fixture
def small_redis(tmp_path):
    server = RedisServer(tmp_path / "redis", extra_args=("--appendonly", "no", "--maxmemory-policy", "noeviction"))
    server.start()
    yield server
    server.stop()


def fill(server: RedisServer, headroom: int = 0) -> None:
    """Set maxmemory to what is used now plus `headroom` bytes: writes beyond that are refused."""
    r = server.client()
    used = r.info("memory")["used_memory"]
    r.config_set("maxmemory", used + headroom)
    r.close()


def backlog(server: RedisServer, ns: str) -> int:
    r = server.client()
    total = sum(r.xlen(s) for s in Keys(ns).all_jobs(None))
    r.close()
    return total


def test_submit_at_oom_raises_server_refused_without_payload_bytes(small_redis, namespace):
    with Client(small_redis.url, namespace) as client:
        fill(small_redis)
        with pytest.raises(ServerRefused) as refused:
            client.submit(SECRET * 100, max_tokens=8)
        message = str(refused.value)
        assert "out of memory" in message and "nothing of this call was enqueued" in message
        assert SECRET not in message and "\\x" not in message and "b'" not in message
        assert refused.value.__cause__ is None and refused.value.__suppress_context__
        assert backlog(small_redis, namespace) == 0


def test_submit_many_at_oom_enqueues_none_of_the_batch_and_a_retry_enqueues_each_once(small_redis, namespace):
    requests = [{"prompt": f"{i} " + "x" * 100_000, "max_tokens": 8} for i in range(10)]
    with Client(small_redis.url, namespace) as client:
        fill(small_redis, headroom=350_000)  # room for about three of the ten 100 kB jobs
        with pytest.raises(ServerRefused):
            client.submit_many(requests, progress=False)
        assert backlog(small_redis, namespace) == 0  # before: 3 enqueued and no handles returned
        small_redis.client().config_set("maxmemory", 0)
        handles = client.submit_many(requests, progress=False)
        assert len({h.job_id for h in handles}) == 10 and backlog(small_redis, namespace) == 10


def test_idempotent_submit_many_at_oom_claims_no_key(small_redis, namespace):
    requests = [{"prompt": f"job {i}", "max_tokens": 8, "idempotency_key": f"key-{i}"} for i in range(10)]
    with Client(small_redis.url, namespace) as client:
        fill(small_redis)
        with pytest.raises(ServerRefused):
            client.submit_many(requests, progress=False)
        r = small_redis.client()
        assert backlog(small_redis, namespace) == 0 and not r.keys(f"{namespace}:idem:*")


def test_a_client_starts_at_oom_when_its_groups_exist_and_says_why_when_they_do_not(small_redis, namespace):
    Client(small_redis.url, namespace).close()  # creates the job groups
    fill(small_redis)
    with Client(small_redis.url, namespace) as client:  # before: OutOfMemoryError from XGROUP CREATE MKSTREAM
        with pytest.raises(ServerRefused):
            client.submit("hello", max_tokens=4)
    with pytest.raises(ServerRefused, match="out of memory"):
        Client(small_redis.url, namespace + "-new")


def test_the_async_client_starts_and_refuses_cleanly_at_oom(small_redis, namespace):
    Client(small_redis.url, namespace).close()
    fill(small_redis)

    async def main():
        async with AsyncClient(small_redis.url, namespace) as client:
            with pytest.raises(ServerRefused) as refused:
                await client.submit(SECRET, max_tokens=4)
            assert SECRET not in str(refused.value)
            with pytest.raises(ServerRefused):
                await client.submit_many([{"prompt": SECRET, "max_tokens": 4}] * 5, progress=False)

    asyncio.run(main())
    assert backlog(small_redis, namespace) == 0


def test_a_read_only_replica_is_a_typed_refusal_too(small_redis, tmp_path, namespace):
    Client(small_redis.url, namespace).close()
    replica = RedisServer(tmp_path / "replica", extra_args=("--appendonly", "no", "--replicaof", "127.0.0.1",
                                                            str(small_redis.port))).start()
    try:
        r = replica.client()
        wait_for(lambda: r.exists(*Keys(namespace).all_jobs(None)) == 3, 20, "the job streams on the replica")
        with Client(replica.url, namespace) as client:
            with pytest.raises(ServerRefused, match="read-only replica"):
                client.submit("hello", max_tokens=4)
    finally:
        replica.stop()
