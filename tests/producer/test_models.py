"""Model routing in the SDK, `kvgate submit --model`, `kvgate batch` body.model, `kvgate stats` per model."""
from __future__ import annotations

import asyncio
import json

import pytest

from kvgate.commands.cli import main
from kvgate.producer import AsyncClient, InvalidRequest
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD, PROTOCOL_VERSION, Job, ProtocolError, check_model_name, decode_job, encode
from kvgate.worker.heartbeat import write_beat
from tests.producer.conftest import FakeWorker


def _jobs(r, stream: str) -> list[Job]:
    return [decode_job(fields[FIELD.encode()]) for _, fields in r.xrange(stream)]


@pytest.mark.parametrize("name", ["random:qwen2.5-0.5b", "HuggingFaceTB/SmolLM2-135M-Instruct", "a", "x" * 128])
def test_model_names_with_colons_and_slashes_are_valid(name):
    assert check_model_name(name) == name
    assert Keys("ns").jobs(name, "high") == f"ns:jobs:{name}:high"


@pytest.mark.parametrize("name", ["", "two words", "tab\there", "{tag}", "a}", "a,b", "x" * 129, "bell\x07"])
def test_bad_model_names_are_refused_by_the_protocol_and_the_sdk_naming_the_field(name, client, redis_server, keys):
    with pytest.raises(ProtocolError, match="model name"):
        check_model_name(name)
    with pytest.raises(InvalidRequest) as err:
        client.submit("hi", model=name)
    assert err.value.errors[0].field == "model" and "model" in str(err.value)
    assert redis_server.client().xlen(keys.jobs(None, "normal")) == 0


def test_a_job_names_its_model_and_lands_on_that_models_stream_but_never_in_the_model_set(client, redis_server, keys):
    r = redis_server.client()
    named = client.submit("hi", model="org/m-1", priority="high")
    plain = client.submit("hi")
    (job,) = _jobs(r, keys.jobs("org/m-1", "high"))
    assert job.job_id == named.job_id and job.model == "org/m-1"
    (job,) = _jobs(r, keys.jobs(None, "normal"))
    assert job.job_id == plain.job_id and job.model is None
    assert r.xlen("%s:jobs:default:normal" % keys.ns) == 1
    assert r.smembers(keys.models()) == set()  # only workers and operators make a model known (issue 26.4)
    # the workers' group exists at id 0 on the new model's streams: a worker started later reads the job
    assert [g["name"] for g in r.xinfo_groups(keys.jobs("org/m-1", "high"))] == [Keys.GROUP.encode()]
    assert r.xinfo_groups(keys.jobs("org/m-1", "high"))[0]["last-delivered-id"] == b"0-0"


def test_submit_many_routes_each_request_to_its_own_model(client, redis_server, keys):
    client.submit_many([{"prompt": "a", "model": "m1"}, {"prompt": "b", "model": "m2"}, {"prompt": "c"},
                        {"prompt": "d", "model": "m1", "priority": "low"}])
    r = redis_server.client()
    assert [j.prompt for j in _jobs(r, keys.jobs("m1", "normal"))] == ["a"]
    assert [j.prompt for j in _jobs(r, keys.jobs("m1", "low"))] == ["d"]
    assert [j.prompt for j in _jobs(r, keys.jobs("m2", "normal"))] == ["b"]
    assert [j.prompt for j in _jobs(r, keys.jobs(None, "normal"))] == ["c"]


def test_a_bad_model_in_submit_many_enqueues_nothing(client, redis_server, keys):
    with pytest.raises(InvalidRequest) as err:
        client.submit_many([{"prompt": "a", "model": "m1"}, {"prompt": "b", "model": "m 2"}])
    assert err.value.errors[0].field == "requests[1].model"
    assert redis_server.client().xlen(keys.jobs("m1", "normal")) == 0


def test_the_async_client_routes_by_model_and_reads_the_serving_model(redis_server, keys):
    fake = FakeWorker(redis_server.client(), keys, model="m-async")

    async def go():
        async with AsyncClient(redis_server.url, keys.ns) as client:
            handle = await client.submit("hi", model="m-async")
            (job,) = await asyncio.to_thread(fake.take)
            fake.final(job, text="ok", model="m-async-canonical")
            return await handle.result(timeout=10)

    result = asyncio.run(go())
    assert result.text == "ok" and result.model == "m-async-canonical"


def test_backpressure_counts_the_backlog_of_every_known_model(redis_server, keys):
    from kvgate.producer import Backpressure, Client
    from kvgate.producer.model_set import add_models
    from kvgate.producer.steps import run

    run(add_models(redis_server.client(), keys, ["m1", "m2"]))  # as their workers do when they start
    with Client(redis_server.url, keys.ns, max_backlog=2) as client:
        client.submit("a", model="m1")
        client.submit("b", model="m2")
        client._gate.force()
        with pytest.raises(Backpressure):
            client.submit("c", model="m3")


def _cli(redis_url, namespace, *argv) -> int:
    return main([argv[0], "--redis-url", redis_url, "--namespace", namespace, *argv[1:]])


def test_submit_command_sends_the_job_to_the_model_given(redis_server, keys, capsys):
    assert _cli(redis_server.url, keys.ns, "submit", "hi", "--model", "org/m", "--no-wait") == 0
    job_id = capsys.readouterr().out.strip()
    (job,) = _jobs(redis_server.client(), keys.jobs("org/m", "normal"))
    assert job.job_id == job_id and job.model == "org/m"
    assert _cli(redis_server.url, keys.ns, "submit", "hi", "--model", "bad name", "--no-wait") == 2
    assert "model" in capsys.readouterr().err


def test_batch_routes_each_line_by_body_model_and_reports_the_serving_model(redis_server, keys, tmp_path):
    import threading

    workers = [FakeWorker(redis_server.client(), keys, name=f"fake-{m}", model=m) for m in ("m-a", "m-b")]
    stop = threading.Event()

    def serve(fake: FakeWorker):
        while not stop.is_set():
            for job in fake.take("low", block_ms=20):
                fake.final(job, text=f"{fake.model} says hi", token_ids=[1], model=f"{fake.model}-canonical")

    for fake in workers:
        fake.ensure_groups()
    threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    rows = [{"custom_id": f"{m}-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": m, "prompt": "x", "max_tokens": 2}} for m in ("m-a", "m-b") for i in range(2)]
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                 "body": {"model": "no good", "prompt": "x"}})
    rows.append({"custom_id": "typo", "method": "POST", "url": "/v1/completions",
                 "body": {"model": "m-c", "prompt": "x"}})  # before: waited in streams nobody reads, to --timeout
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    try:
        assert _cli(redis_server.url, keys.ns, "batch", str(src), "-o", str(out), "--no-progress",
                    "--timeout", "20") == 0
    finally:
        stop.set()
        for t in threads:
            t.join(5)
    by_id = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for m in ("m-a", "m-b"):
        for i in range(2):
            body = by_id[f"{m}-{i}"]["response"]["body"]
            assert body["choices"][0]["text"] == f"{m} says hi" and body["model"] == f"{m}-canonical"
    assert by_id["bad"]["response"] is None and "model" in by_id["bad"]["error"]["message"]
    typo = by_id["typo"]["error"]
    assert typo["code"] == "model_not_found" and "'m-c' is not known" in typo["message"], typo
    assert "kvgate models add m-c" in typo["message"] and "m-a" in typo["message"], typo


def test_stats_show_backlog_per_model_and_flag_a_model_with_no_live_worker(redis_server, keys, client, capsys):
    r = redis_server.client()
    assert _cli(redis_server.url, keys.ns, "models", "add", "lonely") == 0  # an operator expects it: scale from zero
    client.submit_many([{"prompt": "x", "model": "lonely", "priority": "high"}] * 3)
    client.submit("y", model="served")
    client.submit("z", model="lonley")  # a typo: nobody made it known, so nobody counts it
    write_beat(r, keys, "w1", {"worker_id": "w1", "model": "served", "models": "served,default", "updated_at": 0,
                               "state": "serving"}, ttl_s=60)
    stats = client.stats()
    assert stats.models["lonely"].backlog == 3 and stats.models["lonely"].waiting_for_workers
    assert stats.models["served"].backlog == 1 and stats.models["served"].workers == ["w1"]
    assert not stats.models["served"].waiting_for_workers and stats.backlog == 4
    assert stats.priorities["high"].backlog == 3 and stats.priorities["normal"].backlog == 1
    assert stats.workers[0].models == ["served", "default"] and "lonley" not in stats.models
    assert _cli(redis_server.url, keys.ns, "stats") == 0
    table = capsys.readouterr().out
    lonely = next(line for line in table.splitlines() if line.startswith("lonely"))
    assert "no live worker: waiting for scale-up" in lonely and " 3 " in lonely
    assert "served by 1 worker(s): w1" in next(line for line in table.splitlines() if line.startswith("served"))
    assert _cli(redis_server.url, keys.ns, "stats", "--json") == 0
    body = json.loads(capsys.readouterr().out)
    assert body["models"]["lonely"]["waiting_for_workers"] is True and body["models"]["lonely"]["backlog"] == 3


def test_the_models_command_lists_adds_and_removes_known_models_and_refuses_a_bad_name(redis_server, keys, capsys):
    assert _cli(redis_server.url, keys.ns, "models", "add", "org/m", "random:qwen3-0.6b", "org/m") == 0
    assert "added 2 of 2 models" in capsys.readouterr().out
    assert _cli(redis_server.url, keys.ns, "models") == 0
    assert capsys.readouterr().out.split() == ["default", "org/m", "random:qwen3-0.6b"]
    assert _cli(redis_server.url, keys.ns, "models", "add", "two words") == 2
    assert "model name 'two words'" in capsys.readouterr().err
    assert _cli(redis_server.url, keys.ns, "models", "remove", "org/m") == 0
    assert redis_server.client().smembers(keys.models()) == {b"random:qwen3-0.6b"}
    assert _cli(redis_server.url, keys.ns, "models", "add") == 2
    assert "name at least one model" in capsys.readouterr().err


def test_a_raw_job_with_an_unknown_field_type_for_model_is_a_protocol_error():
    job = Job(v=PROTOCOL_VERSION, job_id="j", client_id="c", enqueued_at=1.0, prompt="x", model="ok")
    assert decode_job(encode(job)).model == "ok"
    job.model = "not ok"
    with pytest.raises(ProtocolError, match="whitespace"):
        decode_job(encode(job))
