"""Same idempotency key -> the same job, computed once; a different body under the same key is refused."""
from __future__ import annotations

import time

import pytest

from kvgate.producer import Client, IdempotencyConflict
from kvgate.producer.protocol import EMBEDDING_FIELDS, SAMPLING_FIELDS
from kvgate.producer.request import NEWER_THAN_DIGESTS, validate_request

# Digests as the SDK computed them before issue 43 made a field's place in the digest a marker on the field (NEWER)
# instead of a list: Redis holds digests like these under idempotency keys, and a resubmission after an upgrade must
# match them. The requests use none, one wire-declared and one SDK-declared newer field.
STORED_DIGESTS = [
    ({"prompt": "hi", "max_tokens": 3}, "888fa9bdd2534caacbfa5766356fb23a"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "stop": ["x"]},
     "2aaefbce766f89eab5d5b60fbc081d04"),
    ({"prompt": "hi", "min_p": 0.1}, "36d9cd5b3b64f5590bce25801abbb309"),
    ({"prompt": "hi", "task": "embed", "dimensions": 8}, "e8375492eaed2fba21d649df22d3e3dc"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "3f534f759f551da53b7aa9a95572f348"),
]


@pytest.mark.parametrize("request_, digest", STORED_DIGESTS, ids=["plain", "chat", "min_p", "embed", "tools"])
def test_a_requests_digest_is_the_one_earlier_releases_stored(request_, digest):
    assert validate_request(request_).digest() == digest


# Digests as the SDK computed them before the Job's own fields were declared once on the wire Job, with their place in
# the digest a marker there (fields.NotDigested) instead of a list: every job-level argument is given in one of them,
# and those a digest leaves out (idempotency_key, deadline, prefix_key, tenant) with values that must not count.
JOB_FIELD_DIGESTS = [
    ({"prompt": "Summarise X", "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "stop": "END",
      "seed": 7, "logit_bias": {5: -100.0}, "min_p": 0.05, "priority": "high", "metadata": {"order": "17"},
      "model": "org/name", "stream": True, "ttl_s": 60.0, "idempotency_key": "k-1", "prefix_key": "p",
      "tenant": "team-a"}, "6e0d4e011de9fef7fa99949af587e078"),
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"}],
      "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {
          "type": "object", "properties": {"city": {"type": "string"}}}}}],
      "tool_choice": "required", "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": False},
      "add_generation_prompt": True, "deadline": time.time() + 3600, "tenant": "team-b"},
     "0c58e93b4165a2f0bcdae2f5904473c6"),
    ({"prompt": "count me", "task": "tokenize", "add_special_tokens": False}, "9c3c0e46986a317b4840da05be40b4ae"),
    ({"prompt_token_ids": [1, 2, 3], "task": "detokenize"}, "f27a9f41dadaf232dbe9336734392570"),
    ({"prompt": "embed me", "task": "embed", "pooling": "mean", "normalize": False, "dimensions": 16,
      "metadata": {"a": "b"}}, "942f6da244fd9f0de4461c3558b00d76"),
    ({"prompt": "def f(", "suffix": "\n    return x", "max_tokens": 8, "temperature": 0.0},
     "ee9f6f4aeeaa588c7de9fb796b147dc9"),
    ({"prompt": "json please", "response_format": {"type": "json_object"}, "priority": "low"},
     "6559d2c69efe9cd820e7bbc77a1b4379"),
]


@pytest.mark.parametrize("request_, digest", JOB_FIELD_DIGESTS,
                         ids=["sampling", "tools", "tokenize", "detokenize", "embed", "suffix", "structured"])
def test_a_requests_digest_is_the_one_stored_before_job_fields_were_declared_on_the_wire(request_, digest):
    assert validate_request(request_).digest() == digest


def test_a_wire_field_marked_newer_than_digests_is_left_out_of_the_digest_at_its_default():
    marked = {s.name for s in SAMPLING_FIELDS + EMBEDDING_FIELDS if s.newer_than_digests}
    assert {"min_p", "logit_bias", "dimensions"} <= marked <= set(NEWER_THAN_DIGESTS)
    assert "max_tokens" not in NEWER_THAN_DIGESTS  # a field digests always held stays in at its default


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
