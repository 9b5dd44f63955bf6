"""submit puts a decodable Job on the right priority stream; results, streams, cancel and get round-trip."""
from __future__ import annotations

import threading
import time

import pytest

from kvgate.producer import ResultTimeout
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD, decode_job


@pytest.mark.parametrize("priority", ["high", "normal", "low"])
def test_submit_puts_a_decodable_job_on_its_priority_stream(client, redis_server, keys, priority):
    before = time.time()
    handle = client.submit("Hello", priority=priority, max_tokens=7, temperature=0.0, stop="\n", ttl_s=30,
                           metadata={"user": "u1"}, seed=3)
    r = redis_server.client()
    [(_, fields)] = r.xrange(keys.jobs(None, priority))
    job = decode_job(fields[FIELD.encode()])
    assert job.job_id == handle.job_id and job.client_id == client.client_id
    assert job.prompt == "Hello" and job.priority == priority
    assert job.sampling.max_tokens == 7 and job.sampling.temperature == 0.0 and job.sampling.stop == ["\n"]
    assert job.sampling.seed == 3 and job.metadata == {"user": "u1"}
    assert before + 30 <= job.deadline <= time.time() + 30
    others = [p for p in ("high", "normal", "low") if p != priority]
    assert all(r.xlen(keys.jobs(None, p)) == 0 for p in others)


def test_group_exists_at_id_zero_so_jobs_before_any_worker_are_delivered(client, worker):
    handle = client.submit("early")
    [job] = worker.take()
    assert job.job_id == handle.job_id


def test_client_ids_and_job_ids_are_unguessable_and_distinct(redis_url, namespace):
    from kvgate.producer import Client
    with Client(redis_url, namespace) as a, Client(redis_url, namespace) as b:
        assert a.client_id != b.client_id and len(a.client_id) >= 22
        ids = {a.submit("x").job_id for _ in range(20)}
        assert len(ids) == 20


def test_result_returns_the_final_event_with_timings_and_latency(client, worker):
    handle = client.submit("Hi", metadata={"k": "v"})
    [job] = worker.take()
    worker.final(job, text="Hello there", token_ids=[5, 6, 7])
    result = handle.result(timeout=5)
    assert result.status == "done" and result.text == "Hello there" and result.token_ids == [5, 6, 7]
    assert result.finish_reason == "stop" and result.worker == "fake-worker" and result.metadata == {"k": "v"}
    assert result.usage.completion_tokens == 3 and result.latency_s == pytest.approx(
        result.timings.finished - result.timings.queued)
    assert handle.done()


def test_stream_yields_deltas_in_order_then_ends_at_the_final(client, worker):
    handle = client.submit("Count", stream=True)
    [job] = worker.take()
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(d.text for d in handle.stream(timeout=10)))
    reader.start()
    for i, word in enumerate(["one", " two", " three"]):
        worker.delta(job, i, word, [i])
        time.sleep(0.02)
    worker.delta(job, 1, " two", [1])  # a duplicate is dropped
    worker.final(job, text="one two three.", token_ids=[0, 1, 2, 3])
    reader.join(10)
    assert got == ["one", " two", " three", "."]
    assert "".join(got) == handle.result(timeout=1).text


def test_stream_of_a_non_streaming_job_yields_the_whole_text_once(client, worker):
    handle = client.submit("x")
    [job] = worker.take()
    worker.final(job, text="all at once", token_ids=[1, 2])
    assert [(d.text, d.token_ids) for d in handle.stream(timeout=5)] == [("all at once", [1, 2])]


def test_result_times_out_with_result_timeout_naming_the_job(client):
    handle = client.submit("nobody serves this")
    started = time.monotonic()
    with pytest.raises(ResultTimeout) as info:
        handle.result(timeout=0.3)
    assert 0.25 <= time.monotonic() - started < 2
    assert isinstance(info.value, TimeoutError) and handle.job_id in str(info.value)
    assert not handle.done()


def test_cancel_sets_the_cancel_flag_with_a_ttl_and_the_cancelled_final_arrives(client, worker, redis_server, keys):
    handle = client.submit("long", stream=True)
    [job] = worker.take()
    worker.delta(job, 0, "partial", [1])
    handle.cancel()
    r = redis_server.client()
    assert r.get(keys.cancel(job.job_id)) == b"1" and 0 < r.ttl(keys.cancel(job.job_id))
    worker.final(job, status="cancelled", text="partial", token_ids=[1], finish_reason="abort")
    result = handle.result(timeout=5)
    assert result.status == "cancelled" and result.text == "partial"


def test_get_fetches_a_stored_result_later_and_none_while_running(client, worker):
    handle = client.submit("x")
    assert client.get(handle.job_id) is None
    [job] = worker.take()
    worker.final(job, text="stored")
    handle.result(timeout=5)
    assert client.get(handle.job_id).text == "stored"


def test_missed_final_event_falls_back_to_the_result_key(client, worker):
    handle = client.submit("x")
    [job] = worker.take()
    worker.final(job, text="only stored", publish=False)  # e.g. the reply stream expired meanwhile
    assert handle.result(timeout=8).text == "only stored"


def test_events_that_arrive_before_a_handle_exists_are_kept_for_it(client, worker):
    handle = client.submit("x")
    job_id = handle.job_id
    del handle  # the mailbox is dropped with its handle
    [job] = worker.take()
    worker.final(job, text="early")
    time.sleep(0.3)  # the reader routes the final while no handle exists
    assert client._handle(job_id, foreign=False).result(timeout=1).text == "early"


def test_reply_stream_is_kept_alive_with_a_ttl_and_expires_soon_after_close(redis_url, namespace, redis_server):
    from kvgate.producer import Client
    r = redis_server.client()
    with Client(redis_url, namespace) as c:
        stream = Keys(namespace).reply(c.client_id)
        c.submit("x")
        r.xadd(stream, {"wake": "1"})  # the stream exists once anything lands in it
        c._readers[0].state.next_expire = 0
        time.sleep(1.3)
        assert 60 < r.ttl(stream) <= 3600
    assert 0 < r.ttl(stream) <= 60


def test_close_stops_the_reader_thread_promptly(redis_url, namespace):
    from kvgate.producer import Client
    c = Client(redis_url, namespace)
    started = time.monotonic()
    c.close()
    assert not c._readers[0].is_alive() and time.monotonic() - started < 0.5


def test_as_completed_yields_handles_in_finishing_order(client, worker):
    handles = client.submit_many([{"prompt": f"p{i}"} for i in range(3)], progress=False)
    jobs = {j.job_id: j for j in worker.take(count=3)}
    for h in reversed(handles):
        worker.final(jobs[h.job_id], text=h.job_id)
    done = [h.job_id for h in client.as_completed(handles, timeout=5)]
    assert sorted(done) == sorted(h.job_id for h in handles)


def test_submit_many_enqueues_in_order_with_distinct_ids(client, worker, redis_server, keys):
    handles = client.submit_many([{"prompt": f"p{i}", "max_tokens": 4} for i in range(600)], progress=False)
    assert redis_server.client().xlen(keys.jobs(None, "normal")) == 600
    jobs = worker.take(count=600)
    assert [j.job_id for j in jobs] == [h.job_id for h in handles]
    assert [j.prompt for j in jobs] == [f"p{i}" for i in range(600)]
