"""Job state and lost jobs. `status()` tells queued / running on which worker / finished / lost / unknown, and
`result()` raises JobLost within seconds when the job is in no stream, pending nowhere and has no result (Redis
restarted without persistence): before, waiting clients got only ResultTimeout, with advice to wait longer.
`kvgate get` should call `Client.status(job_id)` for a job without a result."""
from __future__ import annotations

import asyncio
import signal
import time
import uuid

import pytest

from kvgate.producer import AsyncClient, Client, JobLost
from tests.conftest import RedisServer
from tests.reliability.chaos_harness import stop_all
from tests.support import spawn_worker, wait_for

SLOW = ("--simulated", "--sim-step-ms", "20", "--sim-per-token-ms", "0")


@pytest.fixture
def volatile_redis(tmp_path):
    """No append-only file, no snapshot: a restart loses everything."""
    server = RedisServer(tmp_path / "redis", extra_args=("--appendonly", "no"))
    server.start()
    yield server
    server.stop()


def test_status_follows_a_job_from_queued_to_running_on_its_worker_to_finished(redis_server, namespace, tmp_path):
    with Client(redis_server.url, namespace) as client, Client(redis_server.url, namespace) as other:
        handle = client.submit("hello", max_tokens=60, ignore_eos=True)
        assert handle.status().state == "queued"
        assert other.status(uuid.uuid4().hex).state == "unknown"
        worker = spawn_worker(redis_server.url, namespace, *SLOW, worker_id="w-status", log=tmp_path / "w.log")
        try:
            wait_for(lambda: handle.status().state == "running", 30, "the job to run")
            assert handle.status().worker == "w-status"
            assert other.status(handle.job_id).worker == "w-status"  # a bare job id, from another client
            handle.result(timeout=30)
            assert handle.status().state == "finished" and other.status(handle.job_id).state == "finished"
        finally:
            stop_all([worker])


def test_result_raises_job_lost_within_seconds_after_redis_restarts_without_persistence(volatile_redis, namespace):
    with Client(volatile_redis.url, namespace) as client:
        handle = client.submit("hello", max_tokens=4)
        volatile_redis.restart()
        started = time.monotonic()
        with pytest.raises(JobLost, match="in no job stream"):
            handle.result(timeout=25)
        assert time.monotonic() - started < 10
        assert handle.status().state == "lost"


def test_the_async_client_raises_job_lost_and_reports_status(volatile_redis, namespace):
    async def main():
        async with AsyncClient(volatile_redis.url, namespace) as client:
            handle = await client.submit("hello", max_tokens=4)
            assert (await handle.status()).state == "queued"
            volatile_redis.restart()
            started = time.monotonic()
            with pytest.raises(JobLost):
                await handle.result(timeout=25)
            assert time.monotonic() - started < 10
            assert (await handle.status()).state == "lost"

    asyncio.run(main())


def test_a_job_that_finished_is_never_taken_for_lost(redis_server, namespace, tmp_path):
    worker = spawn_worker(redis_server.url, namespace, "--simulated", "--sim-step-ms", "1", worker_id="w-fin",
                          log=tmp_path / "w.log")
    try:
        with Client(redis_server.url, namespace) as client:
            handles = client.submit_many([{"prompt": f"job {i}", "max_tokens": 8} for i in range(50)], progress=False)
            assert {h.result(timeout=30).status for h in handles} == {"done"}
            time.sleep(4.5)  # two liveness checks of the finished jobs' handles
            assert {h.status().state for h in handles} == {"finished"}
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(20)
