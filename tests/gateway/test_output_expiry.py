"""`expires_after` on uploads and `output_expires_after` on batches (issue 44), OpenAI's {anchor: created_at, seconds}:
the file's expires_at is its created_at (the Redis server's clock) plus the seconds; past it the file is gone (not
listed, not read). Short expiries come from a gateway whose test-only file_min_expiry_s is 1."""
from __future__ import annotations

import openai
import pytest
import redis

from tests.gateway.batch_files import jsonl, request, wait_final
from tests.gateway.conftest import start_gateway
from tests.support import wait_for


@pytest.fixture(scope="module")
def client(sim_fleet, tmp_path_factory):
    gw = start_gateway(*sim_fleet, files_dir=str(tmp_path_factory.mktemp("files")), batch_poll_s=0.2,
                       file_min_expiry_s=1, models=["ghost"])  # ghost: lines that wait, for no worker serves it
    with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    gw.stop()


def upload(c, seconds: int | None = None):
    extra = {} if seconds is None else {"expires_after": {"anchor": "created_at", "seconds": seconds}}
    return c.files.create(file=("in.jsonl", jsonl([request(0)])), purpose="batch", **extra)


def test_an_upload_with_expires_after_expires_at_its_created_at_plus_the_seconds(client, sim_fleet):
    f = upload(client, 7200)
    assert f.expires_at == f.created_at + 7200
    with redis.Redis.from_url(sim_fleet[0]) as r:  # stamped on the Redis server's clock
        assert abs(f.created_at - r.time()[0]) <= 2
    assert upload(client).expires_at is None


# Expiries here are a few seconds, not 1: expires_at is whole seconds from a created_at rounded down, so a 1 s file can
# be gone 0.1 s after its upload, before the test's first read on a loaded machine (CI saw a 404 there).
SHORT_S = 4


def test_an_upload_past_its_expiry_is_gone(client):
    f, kept = upload(client, SHORT_S), upload(client)
    assert client.files.retrieve(f.id).id == f.id
    wait_for(lambda: f.id not in [x.id for x in client.files.list()], SHORT_S + 15, "the file to expire")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)
    assert client.files.retrieve(kept.id).id == kept.id


@pytest.mark.parametrize("policy", [{"anchor": "last_active_at", "seconds": 3600}, {"anchor": "created_at"},
                                    {"anchor": "created_at", "seconds": 0}, {"anchor": "created_at",
                                                                             "seconds": 2_592_001},
                                    {"anchor": "created_at", "seconds": "soon"}])
def test_a_bad_expiry_policy_is_refused_naming_the_parameter_and_the_range(client, policy):
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("in.jsonl", jsonl([request(0)])), purpose="batch", expires_after=policy)
    assert e.value.body["param"] == "expires_after" and "2592000 (30 days)" in e.value.body["message"]
    f = upload(client)
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              output_expires_after=policy)
    assert e.value.body["param"] == "output_expires_after" and "2592000 (30 days)" in e.value.body["message"]


def test_a_batch_with_output_expires_after_writes_files_that_expire_so(client):
    batch = client.batches.create(input_file_id=upload(client).id, endpoint="/v1/chat/completions",
                                  completion_window="24h", output_expires_after={"anchor": "created_at",
                                                                                 "seconds": 5400})
    assert "output_expires_after" not in batch.model_dump()  # not a field of OpenAI's Batch
    done = wait_final(client.batches.retrieve, batch.id)
    out = client.files.retrieve(done.output_file_id)
    assert out.purpose == "batch_output" and out.expires_at == out.created_at + 5400


def test_a_batch_output_past_its_expiry_is_gone(client):
    batch = client.batches.create(input_file_id=upload(client).id, endpoint="/v1/chat/completions",
                                  completion_window="24h", output_expires_after={"anchor": "created_at",
                                                                                 "seconds": SHORT_S})
    done = wait_final(client.batches.retrieve, batch.id)
    assert client.files.retrieve(done.output_file_id).expires_at is not None
    wait_for(lambda: done.output_file_id not in [x.id for x in client.files.list()], SHORT_S + 15,
             "the output to expire")
    with pytest.raises(openai.NotFoundError):
        client.files.content(done.output_file_id)


def test_a_running_batch_whose_input_expires_is_cancelled_as_if_the_input_were_deleted(client):
    row = request(0)
    row["body"]["model"] = "ghost"
    f = client.files.create(file=("in.jsonl", jsonl([row])), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": SHORT_S})
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress", 10, "the batch to start")
    done = wait_final(client.batches.retrieve, batch.id, 30)
    assert done.status == "cancelled" and done.request_counts.failed == 1
