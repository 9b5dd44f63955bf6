"""A batch's completion_window (issue 44): any whole number of s, m, h or d from 1 h to 7 d, with expires_at on the
Redis server's clock; past it the batch ends expired as OpenAI's does. Windows of seconds come from a gateway whose
test-only batch_min_window_s is 1."""
from __future__ import annotations

import json

import openai
import pytest
import redis

from kvgate.producer import Client
from kvgate.producer.keys import Keys
from tests.gateway.batch_files import jsonl, request, rows_of, wait_final
from tests.gateway.conftest import running_worker, start_gateway
from tests.support import wait_for


@pytest.fixture(scope="module")
def client(sim_fleet, tmp_path_factory):
    gw = start_gateway(*sim_fleet, files_dir=str(tmp_path_factory.mktemp("files")), batch_poll_s=0.2)
    with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    gw.stop()


def create(c, rows, window):
    f = c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window)


@pytest.mark.parametrize("window, seconds", [("1h", 3600), ("90m", 5400), ("36h", 129600), ("3600s", 3600),
                                             ("7d", 604800)])
def test_a_window_from_1h_to_7d_is_taken_and_expires_at_is_created_at_plus_it(client, sim_fleet, window, seconds):
    batch = create(client, [request(0)], window)
    assert batch.completion_window == window and batch.expires_at == batch.created_at + seconds
    with redis.Redis.from_url(sim_fleet[0]) as r:  # stamped on the Redis server's clock
        assert abs(batch.created_at - r.time()[0]) <= 2
    assert wait_final(client.batches.retrieve, batch.id).status == "completed"


@pytest.mark.parametrize("window", ["30m", "8d", "24", "h", "-1h", "1.5h", "24 h", "0h", 24, None])
def test_a_window_malformed_or_outside_1h_to_7d_is_refused_naming_the_value_and_the_range(client, window):
    f = client.files.create(file=("in.jsonl", jsonl([request(0)])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window)
    err = e.value.body
    assert err["param"] == "completion_window" and err["type"] == "invalid_request_error", err
    assert repr(window) in err["message"] and "from 1h to 7d" in err["message"], err["message"]


def test_a_batch_past_its_window_with_no_worker_ends_expired_with_every_line_batch_expired(shared_redis, namespace,
                                                                                          gateway_factory, tmp_path):
    # --model: the lines wait for the model's first worker rather than failing model_not_found
    gw = gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), batch_poll_s=0.2, batch_min_window_s=1,
                         models=["simulated"])
    with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        batch = create(c, [request(i) for i in range(5)], "2s")
        assert batch.expires_at == batch.created_at + 2
        done = wait_final(c.batches.retrieve, batch.id, 30)
        errors = rows_of(c.files.content(done.error_file_id).content)
    assert done.status == "expired" and done.expired_at >= done.expires_at and done.output_file_id is None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (5, 0, 5)
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [
        (f"req-{i}", None, "batch_expired") for i in range(5)]


def test_a_batch_past_its_window_keeps_its_answers_and_its_unstarted_jobs_expire_unrun(shared_redis, namespace,
                                                                                      gateway_factory, tmp_path):
    """A worker of 2 sequences at 100 ms a token runs 2 of 30 lines a second: a 4 s window answers some. Every job
    carries the window as its deadline, so those still queued are answered expired by the worker, not run."""
    rows = [request(i, max_tokens=8) for i in range(30)]
    with running_worker(shared_redis.url, namespace, "--simulated", "--sim-step-ms", "100", "--max-num-seqs", "2",
                        worker_id="sim-slow-window"), \
            Client(shared_redis.url, namespace) as sdk, redis.Redis.from_url(shared_redis.url) as r:
        gw = gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), batch_poll_s=0.2,
                             batch_min_window_s=1)
        with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            batch = create(c, rows, "4s")
            jobs_key = f"{Keys(namespace).prefix}:batch:{batch.id}:jobs"
            wait_for(lambda: r.hlen(jobs_key) == len(rows), 30, "every line's job submitted")
            job_ids = [json.loads(v)[0] for v in r.hvals(jobs_key)]
            done = wait_final(c.batches.retrieve, batch.id, 30)
            out = rows_of(c.files.content(done.output_file_id).content)
            errors = rows_of(c.files.content(done.error_file_id).content)
        wait_for(lambda: all(sdk.get(j) is not None for j in job_ids), 30, "every job final")
        statuses = [sdk.get(j).status for j in job_ids]
    assert done.status == "expired" and done.expired_at >= done.expires_at
    counts = done.request_counts
    assert 1 <= len(out) == counts.completed < 30 and len(errors) == counts.failed and counts.total == 30
    assert sorted(x["custom_id"] for x in out + errors) == sorted(x["custom_id"] for x in rows)
    assert all(x["response"]["status_code"] == 200 for x in out)
    assert {x["error"]["code"] for x in errors} == {"batch_expired"} and all(x["response"] is None for x in errors)
    assert set(statuses) <= {"done", "expired"} and statuses.count("expired") >= 10, statuses
