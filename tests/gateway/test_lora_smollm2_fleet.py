"""A real worker of the bundled SmolLM2 serves a random PEFT adapter registered through the gateway: the official
openai client names it as its model, and the answer is HF transformers + PEFT's greedy tokens for that adapter."""
from __future__ import annotations

import os
import time

import httpx
import openai
import pytest

pytest.importorskip("torch", reason="a real model needs the worker's torch (make test-pythons runs without it)")
pytest.importorskip("peft", reason="the adapter is made with peft (a dev dependency of the torch install)")

import torch  # noqa: E402

from kvgate.producer import Client  # noqa: E402
from tests.gateway.conftest import running_worker, start_gateway  # noqa: E402

PROMPT = "The capital of France is"
NEW = 8


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from kvgate.engine.loader import resolve_model
    from tests.engine.lora_adapters import hf_greedy, make_adapter

    source = resolve_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("fleet_lora") / "sql"
    prompt = source.tokenizer.encode(PROMPT)
    twin = make_adapter(hf, folder, seed=7, r=8, alpha=16, scale=0.3)
    return str(folder), hf_greedy(twin, prompt, NEW), hf_greedy(hf, prompt, NEW)


def test_the_openai_client_gets_the_adapters_own_greedy_answer_from_a_real_worker(shared_redis, adapter):
    folder, with_adapter, base = adapter
    assert with_adapter != base  # the adapter changes what the model says
    ns = f"gwr{os.getpid()}-{time.monotonic_ns() % 10**8}"
    with running_worker(shared_redis.url, ns, "--model", "smollm2-135m", "--served-model-name", "smol",
                        "--max-loras", "1", "--kv-cache-memory", str(32 << 20), worker_id="w-smol", timeout=300):
        gw = start_gateway(shared_redis.url, ns, models_cache_s=0.0)
        try:
            load = httpx.post(f"{gw.base_url}/load_lora_adapter", json={"lora_name": "sql", "lora_path": folder})
            assert load.status_code == 200, load.text
            client = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=120)
            answers = {}
            for model in ("sql", "smol"):
                out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0)
                assert out.model == model
                with Client(shared_redis.url, ns) as sdk:
                    answers[model] = sdk.get(out.id.split("-", 1)[1]).token_ids
        finally:
            gw.stop()
    assert answers["sql"] == with_adapter[:len(answers["sql"])] and answers["sql"]
    assert answers["smol"] == base[:len(answers["smol"])]
