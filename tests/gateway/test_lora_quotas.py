"""A tenant's quota at the gateway counts its requests for a LoRA adapter (model=<adapter>) as for its base model:
over its jobs in flight it gets the same 429, whichever of them it names."""
from __future__ import annotations

import httpx
import redis

from kvgate import Client
from kvgate.producer.keys import Keys
from tests.gateway.test_quotas import KEYS, hang_up_after, wait_until


def _chat(gw, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=10, headers={"Authorization": "Bearer sk-a"})


def test_a_tenant_over_its_jobs_quota_gets_a_429_for_an_adapter_as_for_its_base_model(
        shared_redis, namespace, gateway_factory, tmp_path, monkeypatch):
    quotas = tmp_path / "quotas.toml"
    quotas.write_text("[default]\nmax_jobs = 1\n")
    monkeypatch.setenv("KVGATE_QUOTAS_FILE", str(quotas))
    with Client(shared_redis.url, namespace) as client:
        client.add_lora("c", "/adapters/c", base="m")
    gw = gateway_factory(shared_redis.url, namespace, api_keys=KEYS, models=["m"], models_cache_s=0.0)
    held = hang_up_after(gw, "sk-a", 3.0)  # a job of `m` waits (no worker): team-a's one slot
    r = redis.Redis.from_url(shared_redis.url)
    wait_until(lambda: r.xlen(Keys(namespace).jobs("m", "normal")) == 1, 20, "team-a's job queued")
    over = _chat(gw, "c")
    assert over.status_code == 429, over.text
    assert over.json()["error"]["type"] == "requests" and "team-a" in over.json()["error"]["message"]
    assert r.xlen(Keys(namespace).jobs("c", "normal")) == 0  # nothing of it was enqueued
    held.join(10)
    r.close()
