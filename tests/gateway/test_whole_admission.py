"""One request is admitted whole or not at all (issue 45: 4, 6, 10): its quota, the gateway's backlog limit and its
enqueue cover every job of it, a refusal is a 429 (it may fit later) or a 400 (it never can), and nothing of a
refused request is enqueued. No worker serves `m`: a job that was enqueued stays in its stream, where it is counted."""
from __future__ import annotations

import httpx
import openai
import pytest
import redis

from kvgate.producer import Client, InvalidRequest, Quota
from kvgate.producer.keys import Keys


def queued(url: str, ns: str) -> int:
    """Jobs in model m's streams, every priority."""
    with redis.Redis.from_url(url) as r:
        return sum(r.xlen(s) for s in Keys(ns).all_jobs("m"))


def embed(gw, inputs: list, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(f"{gw.base_url}/embeddings", json={"model": "m", "input": inputs}, timeout=timeout)


def hold(url: str, ns: str, jobs: int, **client) -> Client:
    """A producer of tenant `default` whose `jobs` queued jobs count against the quota and the backlog."""
    c = Client(url, ns, tenant="default", **client)
    c.submit_many([{"prompt": "held", "model": "m", "max_tokens": 1}] * jobs, chunk_size=jobs)
    return c


def test_embeddings_over_a_300_job_quota_are_refused_whole_and_nothing_is_enqueued(shared_redis, namespace,
                                                                                    gateway_factory):
    gw = gateway_factory(shared_redis.url, namespace, models=["m"], tenant_max_jobs=300, request_timeout_s=2)
    never = embed(gw, ["x"] * 600)  # more than the whole quota: no wait can admit it
    assert never.status_code == 400, never.text
    error = never.json()["error"]
    assert error["param"] == "input" and "max_jobs=300" in error["message"] and "600" in error["message"]
    assert queued(shared_redis.url, namespace) == 0

    with hold(shared_redis.url, namespace, 200, quota=Quota(max_jobs=300)):
        later = embed(gw, ["x"] * 200)  # fits the quota once the held jobs end
        assert later.status_code == 429, later.text
        assert later.json()["error"]["code"] == "rate_limit_exceeded" and "max_jobs=300" in later.text
        assert queued(shared_redis.url, namespace) == 200  # the held ones, none of the refused request


def test_a_512_input_request_under_max_backlog_300_is_refused_whole(shared_redis, namespace, gateway_factory):
    gw = gateway_factory(shared_redis.url, namespace, models=["m"], max_backlog=300, request_timeout_s=2)
    never = embed(gw, ["x"] * 512)
    assert never.status_code == 400, never.text
    assert "max_backlog=300" in never.text and never.json()["error"]["param"] == "input"
    assert queued(shared_redis.url, namespace) == 0

    with hold(shared_redis.url, namespace, 200):
        later = embed(gw, ["x"] * 200)  # 200 waiting plus 200 would pass 300
        assert later.status_code == 429, later.text
        assert later.json()["error"]["code"] == "queue_full" and "adds 200" in later.text
        assert queued(shared_redis.url, namespace) == 200


def test_embeddings_token_ids_are_bounded_by_max_prompt_token_ids(shared_redis, namespace, gateway_factory):
    gw = gateway_factory(shared_redis.url, namespace, models=["m"], request_timeout_s=2)
    big = embed(gw, [[7] * 500] * 2048, timeout=60)  # 1,024,000 ids, 8x the default limit
    assert big.status_code == 400, big.text
    error = big.json()["error"]
    assert error["param"] == "input" and "1024000" in error["message"] and "131072" in error["message"]
    assert "--max-prompt-token-ids" in error["message"]
    assert queued(shared_redis.url, namespace) == 0


def test_max_tokens_over_the_whole_tokens_per_minute_is_a_400_naming_it_not_a_429(shared_redis, namespace,
                                                                                  gateway_factory):
    gw = gateway_factory(shared_redis.url, namespace, models=["m"], tenant_tokens_per_minute=1000,
                         request_timeout_s=2)
    client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5000)
    error = e.value.body
    assert error["param"] == "max_tokens" and "tokens_per_minute=1000" in error["message"], error
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=5000)
    assert e.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # each choice fits, the three together never can
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=400, n=3)
    assert e.value.body["param"] == "n" and "tokens_per_minute=1000" in e.value.body["message"]
    assert queued(shared_redis.url, namespace) == 0

    with Client(shared_redis.url, namespace, quota=Quota(tokens_per_minute=1000)) as sdk:
        with pytest.raises(InvalidRequest) as e:
            sdk.submit("hi", model="m", max_tokens=5000)
        assert e.value.field == "max_tokens" and "tokens_per_minute=1000" in str(e.value)
    assert queued(shared_redis.url, namespace) == 0
