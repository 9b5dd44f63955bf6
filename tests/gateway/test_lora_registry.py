"""LoRA adapters at the gateway: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter register them fleet-wide,
/v1/models lists them with their parent, and an adapter nobody registered is a 404 to the official openai client."""
from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
import redis

from kvgate.producer.keys import Keys
from tests.gateway.conftest import SIM, running_worker, start_gateway

ASK = dict(max_tokens=3, messages=[{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def base_fleet(shared_redis):
    """One simulated worker of `org/base`, and an open gateway reading the fleet afresh on every request."""
    ns = f"gwl{os.getpid()}-{time.monotonic_ns() % 10**8}"
    with running_worker(shared_redis.url, ns, *SIM, "--served-model-name", "org/base", "--max-loras", "2",
                        worker_id="w-base"):
        gw = start_gateway(shared_redis.url, ns, models_cache_s=0.0)
        try:
            yield gw, shared_redis.url, ns
        finally:
            gw.stop()


def test_an_adapter_nobody_registered_is_a_404_to_the_openai_client(base_fleet):
    gw, url, ns = base_fleet
    client = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="customer-404", **ASK)
    assert err.value.body["code"] == "model_not_found"
    assert redis.Redis.from_url(url).xlen(Keys(ns).jobs("customer-404", "normal")) == 0


def test_load_lists_and_unload_an_adapter_as_vllms_server_does(base_fleet):
    gw, url, ns = base_fleet
    load = httpx.post(f"{gw.base_url}/load_lora_adapter", json={"lora_name": "c7", "lora_path": "/adapters/c7"})
    assert load.status_code == 200 and load.text == "Success: LoRA adapter 'c7' added successfully."
    assert redis.Redis.from_url(url).hget(Keys(ns).loras(), "c7") is not None
    client = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    listed = {m.id: m for m in client.models.list()}
    assert listed["c7"].parent == "org/base" and listed["c7"].root == "/adapters/c7"
    assert listed["org/base"].parent is None
    again = httpx.post(f"{gw.base_url}/load_lora_adapter", json={"lora_name": "c7", "lora_path": "/elsewhere"})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(f"{gw.base_url}/load_lora_adapter", json={"lora_name": "two words", "lora_path": "/a"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_name"
    gone = httpx.post(f"{gw.base_url}/unload_lora_adapter", json={"lora_name": "c7"})
    assert gone.status_code == 200 and "removed successfully" in gone.text
    assert httpx.post(f"{gw.base_url}/unload_lora_adapter", json={"lora_name": "c7"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="c7", **ASK)
    assert "c7" not in {m.id for m in client.models.list()}


def test_an_adapter_of_a_base_nobody_serves_or_knows_is_a_404_and_the_base_may_be_named(base_fleet):
    gw, url, ns = base_fleet
    load = httpx.post(f"{gw.base_url}/load_lora_adapter",
                      json={"lora_name": "orphan", "lora_path": "/a", "base_model_name": "org/nobody"})
    assert load.status_code == 200
    client = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="orphan", **ASK)
    httpx.post(f"{gw.base_url}/unload_lora_adapter", json={"lora_name": "orphan"})


def test_only_an_admin_key_may_register_adapters_when_keys_are_set(base_fleet, gateway_factory):
    _, url, ns = base_fleet
    gw = gateway_factory(url, ns, api_keys=["tenant-key=team-a"], admin_keys=["admin-key"])
    body = {"lora_name": "guarded", "lora_path": "/a"}
    as_tenant = httpx.post(f"{gw.base_url}/load_lora_adapter", json=body,
                           headers={"Authorization": "Bearer tenant-key"})
    assert as_tenant.status_code == 403
    as_admin = httpx.post(f"{gw.base_url}/load_lora_adapter", json=body, headers={"Authorization": "Bearer admin-key"})
    assert as_admin.status_code == 200
    assert httpx.post(f"{gw.base_url}/unload_lora_adapter", json={"lora_name": "guarded"},
                      headers={"Authorization": "Bearer admin-key"}).status_code == 200


def test_the_openai_client_names_a_registered_adapter_as_its_model_and_a_worker_of_the_base_answers(base_fleet,
                                                                                                     tmp_path):
    gw, url, ns = base_fleet
    (tmp_path / "adapter_config.json").write_text("{}")  # the simulated engine reads no weights
    load = httpx.post(f"{gw.base_url}/load_lora_adapter", json={"lora_name": "c9", "lora_path": str(tmp_path)})
    assert load.status_code == 200
    client = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=60)
    out = client.chat.completions.create(model="c9", **ASK)
    assert out.model == "c9" and out.choices[0].finish_reason == "length"
    streamed = list(client.completions.create(model="c9", prompt="x y", max_tokens=2, stream=True))
    assert {chunk.model for chunk in streamed} == {"c9"}
    assert httpx.post(f"{gw.base_url}/unload_lora_adapter", json={"lora_name": "c9"}).status_code == 200
