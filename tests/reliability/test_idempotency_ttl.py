"""An idempotency key never points at a result that no longer exists. The workers keep results for
`result_ttl_s` (here 3 s), far less than the claim's 24 h: before, reusing the key after the result expired
returned the old job id and `result()` waited until its timeout. Now the claim script sees the earlier job is
gone (not queued, not running, no result) and enqueues the request as a new job."""
from __future__ import annotations

from kvgate.producer import Client
from tests.reliability.chaos_harness import stop_all
from tests.support import spawn_worker, wait_for

FAST = ("--simulated", "--sim-step-ms", "1", "--sim-per-token-ms", "0")


def test_a_key_reused_after_its_result_expired_runs_the_request_again(redis_server, namespace, tmp_path):
    worker = spawn_worker(redis_server.url, namespace, *FAST, worker_id="w", log=tmp_path / "w.log",
                          env={"KVGATE_RESULT_TTL_S": "3"})
    r = redis_server.client()
    try:
        with Client(redis_server.url, namespace) as client:
            first = client.submit("same body", max_tokens=4, idempotency_key="order-1")
            assert first.result(timeout=30).status == "done"
            again = client.submit("same body", max_tokens=4, idempotency_key="order-1")
            assert again.job_id == first.job_id  # within the result's life: the same job, not run twice
            wait_for(lambda: not r.exists(client.keys.result(first.job_id)), 10, "the result to expire")
            late = client.submit("same body", max_tokens=4, idempotency_key="order-1")
            assert late.job_id != first.job_id
            assert late.result(timeout=10).status == "done"
            assert client.submit("same body", max_tokens=4, idempotency_key="order-1").job_id == late.job_id
    finally:
        stop_all([worker])
