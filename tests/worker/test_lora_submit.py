"""Every way the SDK and `kvgate batch` name a LoRA adapter puts its jobs on the adapter's streams, where a worker of
its base serves them with the adapter: `submit(model=...)` and `lora=`, `submit_many` (both clients) with either, the
async client's submit, and batch lines whose body.model is the adapter. An adapter nobody registered is an
InvalidRequest (SDK) or that line's model_not_found error line (`kvgate batch`), never a job that waits forever."""
from __future__ import annotations

import asyncio
import json

import pytest

from kvgate.commands.cli import main as kvgate
from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer import AsyncClient, Client, InvalidRequest
from kvgate.producer.keys import Keys
from tests.support import simulated_adapter

BASE = "org/base"



@pytest.fixture
def fleet(thread_worker, queue, tmp_path):
    """A simulated worker of BASE with two adapter slots, and adapter `c1` registered; yields (url, ns, engine)."""
    engine = SimulatedEngine(num_blocks=512, max_num_seqs=8, step_overhead_s=0.002, per_token_s=0.00005, max_loras=2)
    with Client(queue.server.url, queue.ns) as client:
        client.add_lora("c1", simulated_adapter(tmp_path, "c1"), BASE)
    with thread_worker(engine=engine, worker_id="w1", served_model_name=BASE, max_loras=2,
                       heartbeat_interval_s=0.1):
        yield queue.server.url, queue.ns, engine


def _served(results, engine) -> list[tuple[str, str | None]]:
    assert "c1" in engine.loras  # the worker loaded the adapter to answer them
    return [(r.status, r.model) for r in results]


def test_submit_with_model_naming_an_adapter_is_served_by_the_adapter(fleet):
    url, ns, engine = fleet
    with Client(url, ns) as client:
        result = client.submit("hi", model="c1", max_tokens=3).result(timeout=60)
    assert _served([result], engine) == [("done", "c1")]


def test_submit_many_takes_lora_or_model_per_request_and_refuses_an_unknown_adapter_before_enqueueing(fleet, queue):
    url, ns, engine = fleet
    with Client(url, ns) as client:
        handles = client.submit_many([{"prompt": "a", "lora": "c1", "max_tokens": 3},
                                      {"prompt": "b", "model": "c1", "max_tokens": 3},
                                      {"prompt": "c", "lora": "c1", "model": BASE, "max_tokens": 3},
                                      {"prompt": "d", "model": BASE, "max_tokens": 3}])
        results = [h.result(timeout=60) for h in handles]
        assert _served(results, engine) == [("done", "c1")] * 3 + [("done", BASE)]
        backlog = queue.r.xlen(Keys(ns).jobs("c1", "low"))
        with pytest.raises(InvalidRequest) as err:
            client.submit_many([{"prompt": "a", "lora": "c1"}, {"prompt": "b", "lora": "nobody"}])
        assert err.value.field == "requests[1].lora" and "kvgate loras add" in str(err.value)
        with pytest.raises(InvalidRequest) as err:
            client.submit_many([{"prompt": "a", "lora": "c1", "model": "other"}])
        assert err.value.field == "requests[0].model" and "adapter of 'org/base'" in str(err.value)
        assert queue.r.xlen(Keys(ns).jobs("c1", "normal")) == 3 and queue.r.xlen(Keys(ns).jobs("c1", "low")) == backlog
        assert queue.r.xlen(Keys(ns).jobs("nobody", "normal")) == 0


def test_the_async_client_submits_to_an_adapter_by_lora_or_model_alone_and_in_many(fleet):
    url, ns, engine = fleet

    async def main_():
        async with AsyncClient(url, ns) as c:
            one = await c.submit("hi", lora="c1", max_tokens=3)
            two = await c.submit("hi", model="c1", max_tokens=3)
            many = await c.submit_many([{"prompt": "a", "lora": "c1", "max_tokens": 3},
                                        {"prompt": "b", "model": "c1", "max_tokens": 3}])
            with pytest.raises(InvalidRequest) as err:
                await c.submit_many([{"prompt": "a", "lora": "c9"}])
            assert err.value.field == "requests[0].lora"
            return [await h.result(timeout=60) for h in (one, two, *many)]

    assert _served(asyncio.run(main_()), engine) == [("done", "c1")] * 4


def test_kvgate_batch_lines_naming_an_adapter_are_served_by_it_and_an_unknown_one_is_its_lines_error(fleet, tmp_path):
    url, ns, engine = fleet
    with Client(url, ns) as client:  # an adapter of a base no worker served and nobody added: its jobs would wait
        client.add_lora("orphan", simulated_adapter(tmp_path, "orphan"), "org/nobody")
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": name}]}}
             for name, model in (("a", "c1"), ("nobody", "c404"), ("base", BASE), ("b", "c1"),
                                                     ("orphan", "orphan"))]
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines.append({**lines[0], "custom_id": "by-lora", "body": {**lines[0]["body"], "lora": "c1"}})  # not OpenAI's
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert kvgate(["batch", str(path), "-o", str(out), "--redis-url", url, "--namespace", ns, "--no-progress"]) == 0
    rows = {row["custom_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["a", "b", "base", "by-lora", "nobody", "orphan"]
    assert {c: rows[c]["response"]["body"]["model"] for c in ("a", "b", "base")} == {"a": "c1", "b": "c1",
                                                                                     "base": BASE}
    assert all(rows[c]["error"] is None for c in ("a", "b", "base")) and "c1" in engine.loras
    error = rows["nobody"]["error"]
    assert rows["nobody"]["response"] is None and error["code"] == "model_not_found"
    assert "'c404'" in error["message"] and "kvgate loras add" in error["message"]
    error = rows["orphan"]["error"]
    assert error["code"] == "model_not_found" and "adapter of 'org/nobody'" in error["message"]
    error = rows["by-lora"]["error"]
    assert error["code"] == "unsupported_parameter" and "adapter is named as body.model" in error["message"]
