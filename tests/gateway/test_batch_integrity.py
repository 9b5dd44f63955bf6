"""A managed batch accounts for every line of its input, always (issue 26, items 4 and 5): a deleted input cancels
it, across a gateway restart too; no rejected line takes a real custom_id; custom_ids of any JSON type are checked
for duplicates; lines for a model nobody serves yet wait without holding up the others, and a model nobody knows
is an error line naming it."""
from __future__ import annotations

import json

import openai
import pytest
import redis

from kvgate.commands.cli import main as kvgate
from kvgate.gateway.batches.file_store import LocalFileStore, namespace_dir
from kvgate.producer.keys import Keys
from tests.gateway.batch_files import jsonl, request, rows_of, wait_final
from tests.gateway.conftest import running_worker
from tests.support import wait_for

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def integrity_gateway(sim_fleet, tmp_path_factory):
    """A small window and fast polls; the operator allows `later`, a model no worker serves yet."""
    from tests.gateway.conftest import start_gateway

    gw = start_gateway(*sim_fleet, files_dir=str(tmp_path_factory.mktemp("files")), batch_window=8,
                       batch_poll_s=0.2, models=("simulated", "default", "later"))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def client(integrity_gateway):
    c = openai.OpenAI(base_url=integrity_gateway.base_url, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def run_batch(client, rows: list[dict] | bytes, timeout: float = 20.0):
    data = rows if isinstance(rows, bytes) else jsonl(rows)
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    return wait_final(client.batches.retrieve, batch.id, timeout=timeout)


def every_line(client, batch) -> list[dict]:
    """The output and error files' lines together."""
    return [row for file_id in (batch.output_file_id, batch.error_file_id) if file_id
            for row in rows_of(client.files.content(file_id).content)]


def test_a_line_without_a_custom_id_fails_the_batch_instead_of_taking_a_real_custom_id(client):
    """The rejected line used to be named `line-2`, the first line's real custom_id: one answer lost, the error
    line written twice, counts {3, 1, 1}."""
    rows = [{**request(0), "custom_id": "line-2"}, {k: v for k, v in request(1).items() if k != "custom_id"},
            request(2)]
    done = run_batch(client, rows)
    assert done.status == "failed", (done.status, done.request_counts)
    assert [(e.code, e.line, e.param) for e in done.errors.data] == [("missing_custom_id", 2, "custom_id")]
    assert "line 2" in done.errors.data[0].message and done.output_file_id is None


def test_custom_ids_of_every_json_type_are_checked_for_duplicates(client):
    """Two lines with custom_id 7, and two with the same object: before, neither pair was seen as a duplicate."""
    rows = [{**request(i), "custom_id": cid} for i, cid in enumerate([7, "7", 7, {"a": [1]}, {"a": [1]}])]
    done = run_batch(client, rows)
    assert done.status == "failed", (done.status, done.request_counts)
    duplicates = [e.message for e in done.errors.data if e.code == "duplicate_custom_id"]
    assert len(duplicates) == 2, done.errors.data
    assert "lines 1, 3" in duplicates[0] and "lines 4, 5" in duplicates[1]
    invalid = [(e.code, e.line) for e in done.errors.data if e.code == "invalid_custom_id"]
    assert invalid == [("invalid_custom_id", n) for n in (1, 3, 4, 5)]


def test_kvgate_batch_refuses_a_file_whose_rejected_line_would_take_a_real_custom_id(sim_fleet, tmp_path, capsys):
    """It used to write custom_id `line-2` twice (the real line's answer and the nameless line's error)."""
    rows = [{**request(0), "custom_id": "line-2"}, {k: v for k, v in request(1).items() if k != "custom_id"}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(jsonl(rows))
    code = kvgate(["batch", str(src), "-o", str(out), "--redis-url", sim_fleet[0], "--namespace", sim_fleet[1],
                   "--no-progress", "--timeout", "20"])
    written = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] if out.exists() else []
    assert code == 2, written
    assert written == [] and "line 2" in capsys.readouterr().err


def test_a_line_for_a_model_nobody_knows_is_an_error_line_naming_it(client, sim_fleet):
    rows = [request(0), {**request(1), "body": {**request(1)["body"], "model": "simulatd-typo"}}, request(2)]
    done = run_batch(client, rows)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 2, 1)
    (bad,) = rows_of(client.files.content(done.error_file_id).content)
    assert bad["custom_id"] == "req-1" and bad["error"]["code"] == "model_not_found"
    assert "simulatd-typo" in bad["error"]["message"]
    with redis.Redis.from_url(sim_fleet[0]) as r:  # never submitted, so never registered as a model
        assert not r.sismember(Keys(sim_fleet[1]).models(), "simulatd-typo")


def test_lines_for_a_model_nobody_serves_yet_do_not_hold_up_the_others(client):
    """300 lines for `later` (allowed, no worker) ahead of 20 for the served model, window 8: before, the `later`
    lines filled the window and none of the 20 was answered."""
    rows = [{**request(i), "body": {**request(i)["body"], "model": "later"}} for i in range(300)]
    rows += [request(i) for i in range(300, 320)]
    f = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    try:
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 20, 20,
                 "the 20 served lines answered while the `later` lines wait")
        assert client.batches.retrieve(batch.id).status == "in_progress"  # the `later` lines still wait
    finally:
        client.batches.cancel(batch.id)
    done = wait_final(client.batches.retrieve, batch.id)
    assert done.status == "cancelled"
    lines = every_line(client, done)
    assert sorted(r["custom_id"] for r in lines) == sorted(r["custom_id"] for r in rows)
    answered = {r["custom_id"] for r in lines if r["error"] is None}
    assert answered == {f"req-{i}" for i in range(300, 320)}
    assert {r["error"]["code"] for r in lines if r["error"]} == {"batch_cancelled"}
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (320, 20, 300)


@pytest.fixture
def slow_fleet(shared_redis, namespace):
    """Two sequences at a time, about 2 s a job: a batch of 40 is mid-run for a long while."""
    with running_worker(shared_redis.url, namespace, "--simulated", "--sim-step-ms", "2", "--max-num-seqs", "2",
                        worker_id="sim-integrity") as fleet:
        yield fleet


@pytest.mark.parametrize("deleted", ["through the API, then a restart", "while no gateway ran"])
def test_deleting_the_input_cancels_the_batch_across_a_restart_with_every_line_accounted_for(
        slow_fleet, gateway_factory, tmp_path, deleted):
    """Before: after the restart the batch ended `completed` with most lines neither answered nor in the error
    file, and the jobs it had queued ran on, never cancelled."""
    url, ns = slow_fleet
    settings = dict(files_dir=str(tmp_path), batch_window=8, batch_poll_s=0.2)
    first = gateway_factory(url, ns, **settings)
    rows = [request(i, max_tokens=1000) for i in range(40)]
    with openai.OpenAI(base_url=first.base_url, api_key="unused", max_retries=0, timeout=30) as c:
        f = c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        with redis.Redis.from_url(url) as r:
            wait_for(lambda: r.hlen(f"{ns}:batch:{batch.id}:jobs") >= 8, 20, "the window submitted")
            # custom_id -> the JSON list of the line's job ids
            jobs = {k.decode(): json.loads(v) for k, v in r.hgetall(f"{ns}:batch:{batch.id}:jobs").items()}
        if deleted == "through the API, then a restart":
            c.files.delete(f.id)
    first.stop()
    if deleted == "while no gateway ran":
        with redis.Redis.from_url(url) as r:
            assert r.hget(f"{ns}:batch:{batch.id}", "status") == b"in_progress"
        assert LocalFileStore(namespace_dir(tmp_path, ns)).delete(f.id)
    second = gateway_factory(url, ns, **settings)
    with openai.OpenAI(base_url=second.base_url, api_key="unused", max_retries=0, timeout=30) as c:
        done = wait_final(c.batches.retrieve, batch.id, timeout=30)
        assert done.status == "cancelled", (done.status, done.request_counts)
        lines = every_line(c, done)
    assert sorted(r["custom_id"] for r in lines) == sorted(r["custom_id"] for r in rows)  # each once
    answered = {r["custom_id"] for r in lines if r["error"] is None}
    assert {r["error"]["code"] for r in lines if r["error"]} == {"batch_cancelled"}
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (40, len(answered), 40 - len(answered))
    with redis.Redis.from_url(url) as r:  # every job it had queued and not answered was asked to stop
        uncancelled = [c for c, ids in jobs.items() if c not in answered
                       and not all(r.exists(Keys(ns).cancel(job)) for job in ids)]
    assert uncancelled == []
