"""Same idempotency key -> the same job, computed once; a different body under the same key is refused."""
from __future__ import annotations

import pytest

from kvgate.producer import Client, IdempotencyConflict


def test_same_key_and_body_returns_the_same_job_enqueued_once(client, redis_server, keys):
    first = client.submit("Summarise X", max_tokens=16, idempotency_key="order-17")
    again = client.submit("Summarise X", max_tokens=16, idempotency_key="order-17")
    assert again.job_id == first.job_id
    assert redis_server.client().xlen(keys.jobs(None, "normal")) == 1


def test_same_key_with_a_different_body_raises_idempotency_conflict(client, redis_server, keys):
    first = client.submit("Summarise X", idempotency_key="order-18")
    with pytest.raises(IdempotencyConflict) as info:
        client.submit("Summarise Y", idempotency_key="order-18")
    assert info.value.job_id == first.job_id and "order-18" in str(info.value)
    assert redis_server.client().xlen(keys.jobs(None, "normal")) == 1


def test_reuse_from_another_client_reads_the_result_through_the_result_key(redis_url, namespace, client, worker):
    first = client.submit("shared work", idempotency_key="order-19")
    with Client(redis_url, namespace) as other:
        reused = other.submit("shared work", idempotency_key="order-19")
        assert reused.job_id == first.job_id
        [job] = worker.take()
        worker.final(job, text="computed once")
        assert reused.result(timeout=5).text == "computed once"
        assert first.result(timeout=5).text == "computed once"


def test_submit_many_dedupes_by_key_within_and_across_calls(client, redis_server, keys):
    handles = client.submit_many([{"prompt": "a", "idempotency_key": "k1"}, {"prompt": "a", "idempotency_key": "k1"},
                                  {"prompt": "b", "idempotency_key": "k2"}], progress=False)
    assert handles[0].job_id == handles[1].job_id != handles[2].job_id
    assert redis_server.client().xlen(keys.jobs(None, "normal")) == 2
