"""OpenAI-dialect clients name a LoRA adapter as their `model` through the gateway: the official openai client's
/v1/batches with lines of an adapter, and LangChain's ChatOpenAI (invoke and stream). A simulated worker of the base
serves them with the adapter loaded; an adapter nobody registered is a 404 (openai.NotFoundError), a line's
model_not_found error in a batch, never a job that waits forever."""
from __future__ import annotations

import json
import os
import time

import openai
import pytest
import redis

from kvgate.producer import Client
from kvgate.producer.keys import Keys
from tests.gateway.batch_files import jsonl, rows_of, wait_final
from tests.gateway.conftest import SIM, running_worker, start_gateway
from tests.support import wait_for

BASE = "org/base"


@pytest.fixture(scope="module")
def adapter_fleet(shared_redis, tmp_path_factory):
    """A simulated worker of BASE with adapter slots, adapter `c7` registered, and a gateway with managed batches."""
    ns = f"gwlc{os.getpid()}-{time.monotonic_ns() % 10**8}"
    folder = tmp_path_factory.mktemp("c7")
    (folder / "adapter_config.json").write_text("{}")  # the simulated engine reads no weights
    with Client(shared_redis.url, ns) as client:
        client.add_lora("c7", str(folder), BASE)
    with running_worker(shared_redis.url, ns, *SIM, "--served-model-name", BASE, "--max-loras", "2",
                        "--heartbeat-interval-s", "0.2", worker_id="w-lc"):
        gw = start_gateway(shared_redis.url, ns, models_cache_s=0.0, files_dir=str(tmp_path_factory.mktemp("files")),
                           batch_window=8, batch_poll_s=0.2)
        try:
            yield gw, shared_redis.url, ns
        finally:
            gw.stop()


def _loaded(url: str, ns: str) -> list[str]:
    """The adapters the worker's slots hold, as its heartbeat says."""
    raw = redis.Redis.from_url(url).hget(Keys(ns).worker("w-lc"), "loras")
    return json.loads(raw)["loaded"] if raw else []


def _line(custom_id: str, model: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": custom_id}]}}


def test_a_managed_batch_of_adapter_lines_is_answered_by_the_adapter_and_an_unknown_one_fails_its_line(
        adapter_fleet):
    gw, url, ns = adapter_fleet
    client = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=60)
    rows = [_line("a", "c7"), _line("nobody", "c404"), _line("base", BASE), _line("b", "c7")]
    f = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_final(client.batches.retrieve, batch.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    out = {r["custom_id"]: r["response"]["body"] for r in rows_of(client.files.content(done.output_file_id).content)}
    assert {c: body["model"] for c, body in out.items()} == {"a": "c7", "base": BASE, "b": "c7"}
    assert all(body["choices"][0]["message"]["content"] for body in out.values())
    (error,) = rows_of(client.files.content(done.error_file_id).content)
    assert error["custom_id"] == "nobody" and error["error"]["code"] == "model_not_found"
    assert "'c404'" in error["error"]["message"]
    wait_for(lambda: "c7" in _loaded(url, ns), 30, "the worker's heartbeat with adapter c7 loaded")
    assert redis.Redis.from_url(url).xlen(Keys(ns).jobs("c404", "low")) == 0


def test_langchain_chat_openai_names_an_adapter_as_its_model_to_invoke_and_stream(adapter_fleet):
    langchain_openai = pytest.importorskip("langchain_openai")
    gw, url, ns = adapter_fleet
    llm = langchain_openai.ChatOpenAI(model="c7", base_url=gw.base_url, api_key="x", max_tokens=4, max_retries=0,
                                      timeout=60)
    ai = llm.invoke("hello")
    assert ai.content and ai.response_metadata["model_name"] == "c7"
    chunks = list(llm.stream("hello"))
    assert "".join(c.content for c in chunks) and {c.response_metadata.get("model_name") for c in chunks} >= {"c7"}
    wait_for(lambda: "c7" in _loaded(url, ns), 30, "the worker's heartbeat with adapter c7 loaded")
    with pytest.raises(openai.NotFoundError) as err:
        langchain_openai.ChatOpenAI(model="c404", base_url=gw.base_url, api_key="x", max_retries=0).invoke("hi")
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"
