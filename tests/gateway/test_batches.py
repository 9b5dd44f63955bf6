"""/v1/files and /v1/batches end to end with the official openai client, against a simulated worker."""
from __future__ import annotations

import asyncio
import threading
import time

import openai
import pytest
import redis

from kvgate.producer.keys import Keys
from kvgate.producer.queue_stats import total_backlog
from tests.gateway.batch_files import COMPLETIONS, jsonl, request, rows_of, wait_final, with_bad_lines
from tests.gateway.conftest import SIM, start_gateway, stop_worker, wait_for_workers
from tests.support import spawn_worker, wait_for


@pytest.fixture(scope="module")
def batch_gateway(sim_fleet, tmp_path_factory):
    """A gateway of its own on the module's fleet: a small batch window, so runs take a few polls."""
    gw = start_gateway(*sim_fleet, files_dir=str(tmp_path_factory.mktemp("files")), batch_window=8,
                       batch_poll_s=0.2)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def client(batch_gateway):
    c = openai.OpenAI(base_url=batch_gateway.base_url, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def upload(client, rows, name="in.jsonl"):
    return client.files.create(file=(name, jsonl(rows)), purpose="batch")


def test_a_chat_batch_completes_with_every_line_answered_once_and_failures_in_the_error_file(client):
    rows = with_bad_lines(200)
    f = upload(client, rows)
    assert f.object == "file" and f.purpose == "batch" and f.bytes == len(jsonl(rows)) and f.filename == "in.jsonl"
    assert client.files.retrieve(f.id).id == f.id
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"run": "e2e"})
    assert batch.status == "validating" and batch.id.startswith("batch_") and batch.metadata == {"run": "e2e"}
    done = wait_final(client.batches.retrieve, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (200, 198, 2)
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    out = rows_of(client.files.content(done.output_file_id).content)
    errors = rows_of(client.files.content(done.error_file_id).content)
    ids = [r["custom_id"] for r in out]
    assert ids == [r["custom_id"] for r in rows if r["custom_id"] not in ("req-3", "req-7")]  # input order, once
    assert sorted(r["custom_id"] for r in errors) == ["req-3", "req-7"]
    assert {r["error"]["code"] for r in errors} == {"unsupported_parameter", "invalid_request"}
    first = out[0]["response"]
    assert first["status_code"] == 200 and first["body"]["object"] == "chat.completion"
    assert first["body"]["model"] == "simulated" and first["body"]["usage"]["completion_tokens"] == 4
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] for r in out)
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_the_async_client_runs_a_completions_batch(batch_gateway):
    async def main():
        async with openai.AsyncOpenAI(base_url=batch_gateway.base_url, api_key="unused", max_retries=0) as c:
            f = await c.files.create(file=("c.jsonl", jsonl([request(i, COMPLETIONS) for i in range(20)])),
                                     purpose="batch")
            batch = await c.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
            while batch.status not in ("completed", "failed", "cancelled", "expired"):
                await asyncio.sleep(0.1)
                batch = await c.batches.retrieve(batch.id)
            return batch, (await c.files.content(batch.output_file_id)).content

    batch, content = asyncio.run(asyncio.wait_for(main(), 60))
    assert batch.status == "completed" and batch.request_counts.completed == 20 and batch.error_file_id is None
    out = rows_of(content)
    assert [r["custom_id"] for r in out] == [f"req-{i}" for i in range(20)]
    assert all(r["response"]["body"]["object"] == "text_completion" for r in out)


def test_batches_list_pages_newest_first(client):
    f = upload(client, [request(0)])
    made = [client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h").id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    nxt = client.batches.list(limit=2, after=page.data[-1].id)
    assert nxt.data[0].id == made[0]
    for batch_id in made:
        assert wait_final(client.batches.retrieve, batch_id).status == "completed"


def test_a_cancelled_batch_stops_with_a_partial_output_and_its_counts(client, sim_fleet):
    rows = [request(i, max_tokens=300) for i in range(120)]  # about 120 / 8 rounds of 300 steps: many seconds
    f = upload(client, rows)
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 60, "a first answer")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_final(client.batches.retrieve, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.completed_at is None
    counts = done.request_counts
    assert counts.total == 120 and 1 <= counts.completed < 120
    out = rows_of(client.files.content(done.output_file_id).content)
    assert len(out) == counts.completed and len({r["custom_id"] for r in out}) == len(out)
    unrun = rows_of(client.files.content(done.error_file_id).content)  # every other line, once
    assert sorted(r["custom_id"] for r in out + unrun) == sorted(r["custom_id"] for r in rows)
    assert {r["error"]["code"] for r in unrun} == {"batch_cancelled"} and counts.failed == len(unrun)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(wait_final(client.batches.retrieve, client.batches.create(
            input_file_id=upload(client, [request(0)]).id, endpoint="/v1/chat/completions",
            completion_window="24h").id).id)


def test_a_file_that_mixes_endpoints_fails_the_batch_with_errors(client):
    f = upload(client, [request(0), request(1, COMPLETIONS)])
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_final(client.batches.retrieve, batch.id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert [(e.code, e.line) for e in done.errors.data] == [("mismatched_endpoint", 2)]


def test_openai_errors_for_bad_purpose_endpoint_file_and_ids(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", jsonl([request(0)])), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b'{"custom_id": "a"}\nnot json\n'), purpose="batch")
    assert e.value.body["param"] == "file" and "line 2" in e.value.message
    f = upload(client, [request(0)])
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="30m")  # under 1h
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    assert e.value.body["param"] == "input_file_id"
    for call in (lambda: client.batches.retrieve("batch_nope"), lambda: client.batches.cancel("batch_nope"),
                 lambda: client.files.retrieve("file-nope"), lambda: client.files.content("file-nope"),
                 lambda: client.files.delete("file-nope")):
        with pytest.raises(openai.NotFoundError):
            call()


def test_files_list_and_delete(client):
    f = upload(client, [request(0)], name="gone.jsonl")
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    deleted = client.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    assert f.id not in [x.id for x in client.files.list()]


def test_uploads_over_the_size_limit_are_refused(sim_fleet, gateway_factory, tmp_path):
    gw = gateway_factory(*sim_fleet, files_dir=str(tmp_path), max_file_bytes=100)
    with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0) as c:
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("big.jsonl", jsonl([request(i) for i in range(5)])), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"


def test_batch_routes_need_the_api_key(sim_fleet, gateway_factory, tmp_path):
    gw = gateway_factory(*sim_fleet, files_dir=str(tmp_path), api_keys=("sk-1",))
    with openai.OpenAI(base_url=gw.base_url, api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.batches.list()
        with pytest.raises(openai.AuthenticationError):
            c.files.create(file=("x.jsonl", jsonl([request(0)])), purpose="batch")


def test_a_batch_past_its_window_ends_expired_with_what_was_answered(client, sim_fleet):
    rows = [request(i, max_tokens=300) for i in range(120)]
    batch = client.batches.create(input_file_id=upload(client, rows).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.expires_at == batch.created_at + 24 * 3600
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 60, "a first answer")
    with redis.Redis.from_url(sim_fleet[0]) as r:  # as if 24 hours had passed
        r.hset(f"{sim_fleet[1]}:batch:{batch.id}", "expires_at", int(time.time()) - 1)
    done = wait_final(client.batches.retrieve, batch.id)
    assert done.status == "expired" and done.expired_at and done.completed_at is None
    out = rows_of(client.files.content(done.output_file_id).content)
    assert 1 <= len(out) == done.request_counts.completed < 120
    unrun = rows_of(client.files.content(done.error_file_id).content)  # every other line, once
    assert sorted(r["custom_id"] for r in out + unrun) == sorted(r["custom_id"] for r in rows)
    assert {r["error"]["code"] for r in unrun} == {"batch_expired"} and done.request_counts.failed == len(unrun)


def test_a_batch_waits_out_a_full_queue_instead_of_failing_lines(shared_redis, namespace, gateway_factory, tmp_path):
    """With --max-backlog 4 the SDK refuses submits while 4 jobs wait; the runner retries them later."""
    proc = spawn_worker(shared_redis.url, namespace, *SIM, worker_id="sim-backlog")
    try:
        wait_for_workers(shared_redis.url, namespace, proc=proc)
        gw = gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), max_backlog=4, batch_window=64,
                             batch_poll_s=0.2)
        backlogs, sampling = [], threading.Event()

        def sample():
            with redis.Redis.from_url(shared_redis.url) as r:
                while not sampling.wait(0.01):
                    backlogs.append(total_backlog(r, Keys(namespace)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            batch = c.batches.create(input_file_id=upload(c, [request(i, max_tokens=50) for i in range(60)]).id,
                                     endpoint="/v1/chat/completions", completion_window="24h")
            done = wait_final(c.batches.retrieve, batch.id)
        sampling.set()
        sampler.join(5)
    finally:
        stop_worker(proc)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (60, 0)
    # the worker takes 16 at a time; with no limit the other 48 of the window would wait in the queue
    assert 0 < max(backlogs) <= 8, max(backlogs)


def test_two_replicas_sharing_a_file_store_run_a_batch_once(sim_fleet, batch_gateway, gateway_factory):
    """Another replica on the same namespace and files: either may drive the batch, exactly one does."""
    files_dir = batch_gateway.server.config.app.state.gateway.settings.files_dir
    other = gateway_factory(*sim_fleet, files_dir=files_dir, batch_window=8, batch_poll_s=0.2)
    with openai.OpenAI(base_url=batch_gateway.base_url, api_key="unused", max_retries=0, timeout=60) as a, \
            openai.OpenAI(base_url=other.base_url, api_key="unused", max_retries=0, timeout=60) as b:
        batches = [a.batches.create(input_file_id=upload(a, [request(i) for i in range(40)]).id,
                                    endpoint="/v1/chat/completions", completion_window="24h") for _ in range(4)]
        for batch in batches:
            done = wait_final(b.batches.retrieve, batch.id)
            assert done.status == "completed" and done.request_counts.completed == 40
            out = rows_of(b.files.content(done.output_file_id).content)
            assert [r["custom_id"] for r in out] == [f"req-{i}" for i in range(40)]
            assert len({r["response"]["request_id"] for r in out}) == 40


def test_cancelling_a_batch_cancels_every_job_of_a_several_input_embeddings_line(shared_redis, namespace,
                                                                                  gateway_factory, tmp_path):
    """One line of 60 inputs is 60 jobs, all of which the line owns: a cancel reaches each one, and the line is one
    batch_cancelled error line, counted once."""
    import json

    from kvgate.producer import Client

    inputs = [f"text {i}" for i in range(60)]
    rows = [{"custom_id": "many", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": "simulated", "input": inputs}}]
    # 2 jobs a 100 ms step: the line takes 3 s, so the cancel lands while most of its jobs wait
    proc = spawn_worker(shared_redis.url, namespace, "--simulated", "--sim-step-ms", "100", "--max-num-seqs", "2",
                        worker_id="sim-cancel-embed")
    try:
        wait_for_workers(shared_redis.url, namespace, proc=proc)
        gw = gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), batch_poll_s=0.2)
        with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c, \
                redis.Redis.from_url(shared_redis.url) as r, Client(shared_redis.url, namespace) as sdk:
            batch = c.batches.create(input_file_id=upload(c, rows).id, endpoint="/v1/embeddings",
                                     completion_window="24h")
            jobs_key = f"{Keys(namespace).prefix}:batch:{batch.id}:jobs"
            wait_for(lambda: r.hexists(jobs_key, "many"), 30, "the line's jobs submitted")
            job_ids = json.loads(r.hget(jobs_key, "many"))
            assert len(set(job_ids)) == len(inputs)  # the line owns one job per input
            c.batches.cancel(batch.id)
            done = wait_final(c.batches.retrieve, batch.id)
            wait_for(lambda: all(sdk.get(j) is not None for j in job_ids), 30, "every job of the line final")
            statuses = [sdk.get(j).status for j in job_ids]
            errors = rows_of(c.files.content(done.error_file_id).content)
    finally:
        stop_worker(proc)
    assert done.status == "cancelled" and done.output_file_id is None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (1, 0, 1)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("many", "batch_cancelled")]
    assert statuses.count("cancelled") >= len(inputs) // 2, statuses  # not left to run: cancelled while waiting
    assert set(statuses) <= {"done", "cancelled"}, statuses
