"""Per-tenant quotas at the gateway (issue 27): counted in Redis, so two replicas enforce one number; answered with
OpenAI's rate-limit error and x-ratelimit-* headers; given back when the jobs finish or are cancelled."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import redis

from kvgate.producer.keys import Keys
from tests.gateway.conftest import SIM, stop_worker, wait_for_workers
from tests.support import spawn_worker

KEYS = ["sk-a=team-a", "sk-b=team-b"]


def chat(gw, key: str, timeout: float = 10.0, max_tokens: int = 4) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=timeout,
                      headers={"Authorization": f"Bearer {key}"})


def hang_up_after(gw, key: str, seconds: float, max_tokens: int = 4) -> threading.Thread:
    """A request whose job waits in the queue (no worker serves `m` yet); the client gives up after `seconds`, so
    the gateway cancels the job, which stays queued (and counted) until a worker reads it."""
    def run():
        try:
            chat(gw, key, timeout=seconds, max_tokens=max_tokens)
        except httpx.TimeoutException:
            pass
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def queued(url: str, ns: str) -> int:
    r = redis.Redis.from_url(url)
    try:
        return r.xlen(Keys(ns).jobs("m", "normal"))
    finally:
        r.close()


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.05)
    return value


@pytest.fixture
def replicas(shared_redis, namespace, gateway_factory, tmp_path, monkeypatch):
    """Two gateways on one Redis namespace, each with the same quotas file (via KVGATE_QUOTAS_FILE), and no worker
    yet: their jobs wait in the queue."""
    quotas = tmp_path / "quotas.toml"
    quotas.write_text("[default]\nmax_jobs = 2\n\n[tenants.team-b]\nmax_jobs = 5\n")
    monkeypatch.setenv("KVGATE_QUOTAS_FILE", str(quotas))
    return [gateway_factory(shared_redis.url, namespace, api_keys=KEYS, models=["m"]) for _ in range(2)]


def test_a_tenant_over_its_jobs_quota_gets_a_429_in_openais_shape_from_either_replica_and_others_are_unaffected(
        shared_redis, namespace, replicas):
    gw1, gw2 = replicas
    held = [hang_up_after(gw1, "sk-a", 3.0), hang_up_after(gw2, "sk-a", 3.0)]
    wait_until(lambda: queued(shared_redis.url, namespace) == 2, 20, "two jobs of team-a queued")

    over = chat(gw2, "sk-a")  # the other replica sees the first's job too
    assert over.status_code == 429, over.text
    error = over.json()["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
    assert "team-a" in error["message"] and "max_jobs=2" in error["message"]
    assert int(over.headers["retry-after"]) >= 1
    assert over.headers["x-ratelimit-limit-requests"] == "2"
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    assert over.headers["x-ratelimit-reset-requests"].endswith("s")
    with pytest.raises(openai.RateLimitError):  # what the official client makes of it
        openai.OpenAI(base_url=gw1.base_url, api_key="sk-a", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)

    other = hang_up_after(gw1, "sk-b", 3.0)  # team-b, under its own quota, is admitted meanwhile
    wait_until(lambda: queued(shared_redis.url, namespace) == 3, 20, "team-b's job queued")
    for t in held + [other]:
        t.join(10)

    # a worker arrives: the cancelled jobs end, their slots come back, and team-a is served again
    proc = spawn_worker(shared_redis.url, namespace, *SIM, "--served-model-name", "m", worker_id="quota-m")
    try:
        wait_for_workers(shared_redis.url, namespace, proc=proc)
        r, keys = redis.Redis.from_url(shared_redis.url), Keys(namespace)
        wait_until(lambda: r.zcard(keys.quota_jobs()) == 0 and r.zcard(keys.quota_leases()) == 0, 60,
                   "every slot given back")
        assert int(r.hget(keys.quota_window(), "jobs")) == 0
        r.close()
        answers = [chat(gw1, "sk-a"), chat(gw2, "sk-a")]
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    finally:
        stop_worker(proc)


def test_a_tenant_over_its_tokens_per_minute_gets_a_429_on_tokens(shared_redis, namespace, gateway_factory,
                                                                   monkeypatch):
    monkeypatch.setenv("KVGATE_TENANT_TOKENS_PER_MINUTE", "300")
    gws = [gateway_factory(shared_redis.url, namespace, api_keys=KEYS, models=["m"]) for _ in range(2)]
    first = hang_up_after(gws[0], "sk-a", 2.0, max_tokens=250)  # charged at admission: prompt + 250 max_tokens
    wait_until(lambda: queued(shared_redis.url, namespace) == 1, 20, "team-a's job queued")
    over = chat(gws[1], "sk-a", max_tokens=100)
    assert over.status_code == 429, over.text
    error = over.json()["error"]
    assert error["type"] == "tokens" and error["code"] == "rate_limit_exceeded"
    assert "tokens_per_minute=300" in error["message"]
    assert over.headers["x-ratelimit-limit-tokens"] == "300"
    assert 0 <= int(over.headers["x-ratelimit-remaining-tokens"]) < 100
    assert 1 <= int(over.headers["retry-after"]) <= 60
    first.join(10)


def test_a_quotas_file_with_a_hostile_tenant_name_stops_the_start(tmp_path):
    from kvgate.gateway import GatewaySettings

    bad = tmp_path / "quotas.toml"
    bad.write_text('[tenants."a|b"]\nmax_jobs = 1\n')
    with pytest.raises(ValueError, match=r"quotas file .*tenants: Value error, tenant 'a\|b' must be 1 to 64"):
        GatewaySettings(quotas_file=str(bad))
