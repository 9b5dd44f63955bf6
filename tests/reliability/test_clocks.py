"""Invariant 9: a job's deadline is measured on the Redis server's clock, so a worker whose own clock is 30 s off
expires exactly the jobs a correct one would. Before, the producer stamped the deadline with its clock and the
worker compared it with its own: 30 s ahead, it expired 10/10 fresh 10 s jobs; 30 s behind, it ran 10/10 expired
ones. The worker's clock is skewed with libfaketime when installed (`apt-get install faketime`), else through
the worker's one test seam for its local clock (KVGATE_TEST_LOCAL_CLOCK_SKEW_S)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvgate.producer import Client
from kvgate.worker.clock import LOCAL_SKEW_ENV
from tests.reliability.chaos_harness import stop_all
from tests.support import spawn_worker

FAKETIME_LIB = Path(os.environ.get("KVGATE_TEST_FAKETIME_LIB", "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"))
FAST = ("--simulated", "--sim-step-ms", "1", "--sim-per-token-ms", "0", "--max-num-seqs", "16")


def skewed(seconds: int) -> dict[str, str]:
    """Environment for a worker process whose clock is `seconds` off the real (and the Redis server's) clock."""
    if FAKETIME_LIB.exists():
        return {"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME": f"{seconds:+d}s"}
    return {LOCAL_SKEW_ENV: str(seconds)}


@pytest.mark.parametrize("skew_s", [30, -30])
def test_fresh_jobs_run_on_a_worker_whose_clock_is_off_by_30_s(redis_server, namespace, tmp_path, skew_s):
    with Client(redis_server.url, namespace) as client:
        handles = [client.submit(f"job {i}", max_tokens=4, ttl_s=10) for i in range(10)]
        worker = spawn_worker(redis_server.url, namespace, *FAST, worker_id="skewed", log=tmp_path / "w.log",
                              env=skewed(skew_s))
        try:
            statuses = [h.result(timeout=30).status for h in handles]
        finally:
            stop_all([worker])
    assert statuses == ["done"] * 10


def test_expired_jobs_expire_on_a_worker_whose_clock_is_30_s_behind(redis_server, namespace, tmp_path):
    with Client(redis_server.url, namespace) as client:
        handles = [client.submit(f"job {i}", max_tokens=4, ttl_s=1) for i in range(10)]
        time.sleep(1.5)  # past every deadline before any worker runs
        worker = spawn_worker(redis_server.url, namespace, *FAST, worker_id="late", log=tmp_path / "w.log",
                              env=skewed(-30))
        try:
            statuses = [h.result(timeout=30).status for h in handles]
        finally:
            stop_all([worker])
    assert statuses == ["expired"] * 10
