"""Queue behaviour of the worker against a real redis-server, with the SimulatedEngine in a thread (fast)."""
from __future__ import annotations

import time

import msgspec

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.limits import MAX_PAYLOAD_BYTES
from kvgate.producer.protocol import PROTOCOL_VERSION, encode


def test_every_job_gets_one_done_result_with_usage_timings_and_the_stored_copy(queue, thread_worker):
    with thread_worker():
        ids = [queue.submit(f"prompt number {i}", max_tokens=5 + i, metadata={"n": str(i)}) for i in range(6)]
        finals = queue.wait_finals(6)
    by_id = {f.job_id: f for f in finals}
    assert sorted(by_id) == sorted(ids) and len(finals) == 6
    for i, job_id in enumerate(ids):
        f = by_id[job_id]
        assert f.status == "done" and f.finish_reason == "length" and f.text
        assert len(f.token_ids) == f.usage.completion_tokens == 5 + i
        assert f.usage.prompt_tokens == 3 and f.metadata == {"n": str(i)} and f.worker
        t = f.timings
        assert t.queued <= t.admitted <= t.first_token <= t.finished
        assert queue.r.get(queue.keys.result(job_id)) is not None
        assert 0 < queue.r.ttl(queue.keys.result(job_id)) <= 86_400
    assert queue.pending() == 0
    assert queue.r.ttl(queue.keys.reply(queue.client_id)) > 0


def test_streaming_deltas_arrive_in_order_before_the_final_and_add_up_to_it(queue, thread_worker):
    with thread_worker():
        job_id = queue.submit("stream me", max_tokens=12, stream=True)
        queue.wait_finals(1)
    events = queue.events()
    deltas, final = events[:-1], events[-1]
    assert [d.index for d in deltas] == list(range(12)) and final.status == "done"
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids and all(d.job_id == job_id for d in deltas)


def test_cancel_mid_generation_aborts_with_partial_text(queue, thread_worker):
    engine = SimulatedEngine(num_blocks=256, max_num_seqs=4, step_overhead_s=0.01)
    with thread_worker(engine, cancel_poll_ms=20):
        job_id = queue.submit("long one", max_tokens=2000, stream=True)
        deadline = time.monotonic() + 10
        while len(queue.events()) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        queue.cancel(job_id)
        (final,) = queue.wait_finals(1)
    assert final.status == "cancelled" and final.finish_reason == "abort"
    assert 5 <= len(final.token_ids) < 2000 and final.text
    assert engine.stats.free_blocks == engine.stats.total_blocks and queue.pending() == 0


def test_a_job_past_its_deadline_is_expired_and_never_run(queue, thread_worker):
    engine = SimulatedEngine(num_blocks=256)
    job_id = queue.submit("too late", deadline=time.time() - 1)
    with thread_worker(engine):
        (final,) = queue.wait_finals(1)
    assert final.job_id == job_id and final.status == "expired" and final.token_ids == []
    assert engine.stats.prompt_tokens == 0 and queue.pending() == 0


def test_high_priority_jobs_are_admitted_before_normal_and_low(queue, thread_worker):
    low = [queue.submit("low", priority="low", max_tokens=2) for _ in range(3)]
    normal = [queue.submit("normal", priority="normal", max_tokens=2) for _ in range(3)]
    high = [queue.submit("high", priority="high", max_tokens=2) for _ in range(3)]
    engine = SimulatedEngine(num_blocks=256, max_num_seqs=1)
    with thread_worker(engine, local_queue_size=2):
        finals = queue.wait_finals(9)
    order = [f.job_id for f in sorted(finals, key=lambda f: f.timings.admitted)]
    assert order[:3] == high and set(order[3:6]) == set(normal) and set(order[6:]) == set(low)


def test_bad_payloads_each_get_an_error_naming_the_problem_and_the_worker_keeps_serving(queue, thread_worker):
    good = queue.job("fine", max_tokens=3)
    bad = {
        "unknown version": encode(msgspec.structs.replace(queue.job(job_id="v9"), v=PROTOCOL_VERSION + 8)),
        "wrong type": msgspec.msgpack.encode({**msgspec.to_builtins(queue.job(job_id="wt")), "prompt": 42}),
        "missing field": msgspec.msgpack.encode({"v": 1, "job_id": "mf", "client_id": queue.client_id}),
        "oversize": msgspec.msgpack.encode({**msgspec.to_builtins(queue.job(job_id="big")),
                                            "prompt": "x" * (MAX_PAYLOAD_BYTES + 10)}),
        "bad sampling": encode(queue.job(job_id="bs", temperature=float("nan"))),
        "too long prompt": encode(queue.job(job_id="tl", prompt_token_ids=list(range(5000)))),
    }
    expected = {"unknown version": "version", "wrong type": "prompt", "missing field": "enqueued_at",
                "oversize": "over the limit", "bad sampling": "temperature", "too long prompt": "max_model_len"}
    ids = {"unknown version": "v9", "wrong type": "wt", "missing field": "mf", "oversize": "big",
           "bad sampling": "bs", "too long prompt": "tl"}
    queue.xadd(b"\xc1 not msgpack at all")
    for payload in bad.values():
        queue.xadd(payload)
    queue.xadd(encode(good))
    with thread_worker():
        finals = {f.job_id: f for f in queue.wait_finals(len(bad) + 1)}
        time.sleep(0.3)
    assert finals[good.job_id].status == "done"
    for name, job_id in ids.items():
        assert finals[job_id].status == "error", name
        assert expected[name] in finals[job_id].error, (name, finals[job_id].error)
    dead = queue.r.xrange(queue.keys.dead())
    assert any(b"malformed" in fields[b"reason"] for _, fields in dead)  # the garbage bytes nobody can be told about
    assert queue.pending() == 0


def test_with_a_tiny_kv_cache_the_worker_holds_only_its_bound_and_the_backlog_stays_in_redis(queue, thread_worker):
    engine = SimulatedEngine(num_blocks=24, block_size=16, max_num_seqs=8, step_overhead_s=0.01)
    ids = [queue.submit(" ".join(["w"] * 40), max_tokens=60) for _ in range(50)]
    bound = engine.max_num_seqs + 3
    peak_pending = 0
    with thread_worker(engine, local_queue_size=3, initial_tokens_per_job=100):
        while queue.pending() == 0:
            time.sleep(0.005)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            pending = queue.pending()
            group = queue.r.xinfo_groups(queue.keys.jobs(None, "normal"))[0]  # no lag field on 6.2: count the rest
            undelivered = len(queue.r.xrange(queue.keys.jobs(None, "normal"), min=b"(" + group["last-delivered-id"]))
            undelivered += queue.parked()  # parked for deadline order: read by no worker (worker/due.py)
            done = len(queue.finals())  # read last: acks only happen together with a final
            peak_pending = max(peak_pending, pending)
            assert pending <= bound, f"{pending} jobs held by one worker, bound {bound}"
            assert undelivered >= 50 - done - bound
            time.sleep(0.02)
        assert 0 < peak_pending <= bound
        assert len(queue.finals()) < 50  # a real backlog was left in Redis
        queue.wait_finals(50, timeout=60)
    assert {f.job_id for f in queue.finals()} == set(ids)
    assert engine.stats.preemptions < 25  # the adaptive reserve keeps recompute rare


def test_a_job_whose_result_already_exists_is_acked_without_a_second_answer(queue, thread_worker):
    """What a redelivery after a lost ack looks like: the stored result wins, the client hears nothing new."""
    job_id = queue.submit("already answered", job_id="answered-once")
    queue.r.set(queue.keys.result(job_id), b"the first answer", ex=600)
    with thread_worker():
        queue.submit("a later job", max_tokens=2)
        queue.wait_finals(1)
        deadline = time.monotonic() + 5
        while queue.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
    assert [f.job_id for f in queue.finals()] != [job_id] and job_id not in {f.job_id for f in queue.finals()}
    assert queue.r.get(queue.keys.result(job_id)) == b"the first answer" and queue.pending() == 0


def test_the_heartbeat_hash_has_every_field_and_a_ttl(queue, thread_worker):
    from kvgate.producer.keys import HEARTBEAT_FIELDS

    with thread_worker(worker_id="hb-worker", heartbeat_ttl_s=7) as tw:
        key = queue.keys.worker("hb-worker")
        deadline = time.monotonic() + 5
        while not queue.r.exists(key) and time.monotonic() < deadline:
            time.sleep(0.02)
        beat = {k.decode(): v.decode() for k, v in queue.r.hgetall(key).items()}
        assert set(beat) == set(HEARTBEAT_FIELDS) and 0 < queue.r.ttl(key) <= 7
        assert beat["state"] == "serving" and int(beat["total_blocks"]) == tw.engine.stats.total_blocks
    assert not queue.r.exists(key)
