"""deploy/redis/acl.conf loads into a real Redis 7 and grants each user what it needs and nothing it must not have."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import redis

from kvgate.producer.keys import Keys
from kvgate.producer.queue_stats import read_queue_stats
from kvgate.worker.heartbeat import write_beat
from tests.support import redis_major

REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(redis_major(REDIS) < 7, reason="ACL selectors need redis-server >= 7 on PATH")


def denied(call) -> bool:
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return True
    except redis.ResponseError as e:
        return "NOPERM" in str(e)
    return False


def test_the_default_user_is_off(acl_server):
    with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
        redis.Redis(port=acl_server("monitor").connection_pool.connection_kwargs["port"]).ping()


def test_producer_adds_jobs_but_cannot_read_the_job_stream_or_list_keys(acl_server):
    keys, producer, worker = Keys("kvgate"), acl_server("producer"), acl_server("worker")
    worker.xgroup_create(keys.jobs(None, "normal"), Keys.GROUP, id="0", mkstream=True)
    producer.xadd(keys.jobs(None, "normal"), {"p": b"job"})
    assert producer.xlen(keys.jobs(None, "normal")) == 1 and producer.xinfo_groups(keys.jobs(None, "normal"))
    assert denied(lambda: producer.xrange(keys.jobs(None, "normal")))
    assert denied(lambda: producer.xread({keys.jobs(None, "normal"): "0"}))
    assert denied(lambda: producer.xreadgroup(Keys.GROUP, "x", {keys.jobs(None, "normal"): ">"}))
    assert denied(lambda: producer.scan(match="kvgate:reply:*"))
    assert denied(lambda: producer.keys("*"))
    assert denied(lambda: producer.xadd(keys.dead(), {"p": b"x"}))
    assert denied(lambda: producer.flushall())


def test_producer_reads_a_reply_stream_and_result_it_knows_the_name_of(acl_server):
    keys, producer, worker = Keys("kvgate"), acl_server("producer"), acl_server("worker")
    worker.xadd(keys.reply("c-7f3a"), {"p": b"delta"})
    worker.set(keys.result("j1"), b"final")
    assert producer.xread({keys.reply("c-7f3a"): "0"})[0][1][0][1] == {b"p": b"delta"}
    assert producer.get(keys.result("j1")) == b"final"
    producer.set(keys.cancel("j1"), 1, ex=60)
    assert denied(lambda: producer.xadd(keys.reply("c-7f3a"), {"p": b"forged"}))
    assert denied(lambda: producer.set(keys.result("j1"), b"forged"))


def test_worker_reads_acks_publishes_and_heartbeats_but_cannot_administer(acl_server):
    keys, producer, worker = Keys("kvgate"), acl_server("producer"), acl_server("worker")
    stream = keys.jobs(None, "high")
    worker.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    producer.xadd(stream, {"p": b"job"})
    (_, [(entry, _)]), = worker.xreadgroup(Keys.GROUP, "w1", {stream: ">"}, count=1)
    finish = worker.register_script("redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', 60) "
                                    "redis.call('XADD', KEYS[2], '*', 'p', ARGV[1]) "
                                    "return redis.call('XACK', KEYS[3], ARGV[2], ARGV[3])")
    assert finish(keys=[keys.result("j"), keys.reply("c"), stream], args=[b"done", Keys.GROUP, entry]) == 1
    worker.hset(keys.worker("w1"), mapping={"worker_id": "w1"})
    worker.xautoclaim(stream, Keys.GROUP, "w1", 0)
    worker.xadd(keys.dead(), {"reason": "invalid"})
    assert denied(lambda: worker.flushall())
    assert denied(lambda: worker.config_get("*"))
    assert denied(lambda: worker.execute_command("CLIENT", "KILL", "ID", "1"))
    assert denied(lambda: worker.keys("*"))
    assert denied(lambda: worker.set("other:key", 1))


def test_monitor_user_serves_the_exporter_but_writes_nothing(acl_server):
    keys, producer, monitor = Keys("kvgate"), acl_server("producer"), acl_server("monitor")
    producer.xadd(keys.jobs(None, "low"), {"p": b"job"})
    write_beat(acl_server("worker"), keys, "w1", {"worker_id": "w1", "free_blocks": 7}, ttl_s=60)  # as workers do
    snap = read_queue_stats(monitor, keys)
    assert snap.priorities["low"].backlog == 1 and snap.workers[0].free_blocks == 7
    from kvgate.producer.protocol import FIELD, PROTOCOL_VERSION, Job, encode
    from kvgate.producer.queue_work import read_queue_work

    producer.xadd(keys.jobs(None, "high"), {FIELD: encode(Job(v=PROTOCOL_VERSION, job_id="j", client_id="c",
                                                             enqueued_at=0.0, prompt_token_ids=[1] * 40))})
    snap = read_queue_stats(monitor, keys)
    work = read_queue_work(monitor, keys, snap)["default"]  # both ends of each stream: XRANGE and XREVRANGE
    assert work.priorities["high"].tokens == 40 + 256  # its prompt and the default max_tokens
    assert denied(lambda: monitor.xadd(keys.jobs(None, "low"), {"p": b"x"}))
    assert denied(lambda: monitor.delete(keys.worker("w1")))


def test_monitor_user_reads_each_tenants_backlog_under_fair_share(acl_server):
    """The per-tenant view reads the ends of each band's backlog set (ZRANGE) and tenants' streams' groups."""
    from kvgate.producer.client import Client

    keys, monitor = Keys("kvgate"), acl_server("monitor")
    acl_server("worker").set(keys.fair(), 1)  # as `kvgate worker --fair-share on` does
    port = monitor.connection_pool.connection_kwargs["port"]
    with Client(f"redis://producer:CHANGE_ME_producer@127.0.0.1:{port}/0", namespace="kvgate", tenant="acme") as c:
        c.submit_many([{"prompt": "x"}] * 3, progress=False)
    view = read_queue_stats(monitor, keys).tenant_view
    assert view.backlog_by_tenant and [(t.tenant, t.backlog) for t in view.top] == [("acme", 3)]


def test_keda_user_reads_group_lag_only(acl_server):
    keys, keda = Keys("kvgate"), acl_server("keda")
    acl_server("worker").xgroup_create(keys.jobs(None, "normal"), Keys.GROUP, id="0", mkstream=True)
    assert keda.xinfo_groups(keys.jobs(None, "normal"))[0]["name"] == Keys.GROUP.encode()
    assert denied(lambda: keda.xrange(keys.jobs(None, "normal")))


def test_the_real_sdk_and_worker_serve_a_job_under_their_least_privilege_users(acl_server):
    """The production code paths, not hand-picked commands: a command missing from acl.conf fails here."""
    import threading

    from kvgate.engine.simulated import SimulatedEngine
    from kvgate.producer.client import Client
    from kvgate.worker.settings import WorkerSettings
    from kvgate.worker.worker import Worker

    port = acl_server("monitor").connection_pool.connection_kwargs["port"]
    url = lambda user: f"redis://{user}:CHANGE_ME_{user}@127.0.0.1:{port}/0"
    settings = WorkerSettings(redis_url=url("worker"), namespace="kvgate", worker_id="acl-w", heartbeat_interval_s=0.1)
    worker = Worker(SimulatedEngine(256, step_overhead_s=0.001, per_token_s=0.0), settings)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        with Client(url("producer"), namespace="kvgate") as client:
            results = [client.submit(f"hello {i}", max_tokens=4).result(timeout=20) for i in range(3)]
            assert [r.status for r in results] == ["done"] * 3, [r.error for r in results]
    finally:
        stop.set()
        thread.join(20)
    assert not thread.is_alive()


def test_a_worker_with_affinity_on_owns_lanes_and_beats_under_its_least_privilege_user(acl_server):
    import threading

    from kvgate.engine.simulated import SimulatedEngine
    from kvgate.worker.settings import WorkerSettings
    from kvgate.worker.worker import Worker

    keys, monitor = Keys("kvgate"), acl_server("monitor")
    port = monitor.connection_pool.connection_kwargs["port"]
    url = f"redis://worker:CHANGE_ME_worker@127.0.0.1:{port}/0"
    settings = WorkerSettings(redis_url=url, namespace="kvgate", worker_id="acl-lanes", heartbeat_interval_s=0.1,
                              affinity="on", affinity_lanes=4)
    worker = Worker(SimulatedEngine(256, step_overhead_s=0.001, per_token_s=0.0), settings)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        for _ in range(100):
            if worker.affinity.own.get("default") and monitor.hgetall(keys.worker("acl-lanes")):
                break
            threading.Event().wait(0.05)
        assert worker.affinity.own["default"] == [0, 1, 2, 3] and monitor.get(keys.lanes()) == b"4"
        assert monitor.hgetall(keys.worker("acl-lanes"))  # the heartbeat after the lane sync ran too
        producer = acl_server("producer")
        assert producer.get(keys.lanes()) == acl_server("gateway").get(keys.lanes()) == b"4"
    finally:
        stop.set()
        thread.join(20)
    assert not thread.is_alive()


def test_a_worker_reads_a_lane_in_deadline_order_and_steals_its_parked_jobs_under_its_least_privilege_user(
        acl_server):
    """The lanes' part of the read script (worker/due.py: parking, and counting a lane's parked jobs for a thief)
    runs only commands the worker user has."""
    import time

    from kvgate.producer.protocol import DUE_FIELD
    from kvgate.worker.reader import Reader, ReadPlan

    keys, worker = Keys("kvgate"), acl_server("worker")
    own, theirs = (keys.jobs(None, "normal", lane) for lane in (0, 1))
    for stream in (own, theirs):
        worker.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    for due_ms in (3_600_000, 60_000, 7_200_000):
        worker.xadd(theirs, {"p": b"job", DUE_FIELD: str(due_ms)})
    owner = Reader(worker, "owner", ReadPlan([theirs, own], home=1), keys=keys, deadline_window=8)
    assert [e.fields[DUE_FIELD.encode()] for e in owner.read(1)] == [b"60000"]  # the earliest due; 2 parked
    time.sleep(0.25)
    thief = Reader(worker, "thief", ReadPlan([own, theirs], home=1), keys=keys, steal_age_ms=200, deadline_window=8)
    assert [e.fields[DUE_FIELD.encode()] for e in thief.read(2)] == [b"3600000"]  # one steal per read
    assert worker.zcard(keys.due_index(theirs)) == 1


def test_the_gateway_serves_chat_models_and_batches_as_its_acl_user_with_a_worker_as_its_own(acl_server, tmp_path):
    """The whole path under least privilege: the gateway user enqueues, lists models, reads replies, runs a managed
    batch and delivers its webhook event from the outbox; the monitor user reads the webhook counts (kvgate stats)."""
    import openai

    from tests.gateway.conftest import SIM, start_gateway, stop_worker
    from tests.gateway.webhook_receiver import Receiver, new_secret
    from tests.support import spawn_worker, wait_for

    port = acl_server("monitor").connection_pool.connection_kwargs["port"]
    url = lambda user: f"redis://{user}:CHANGE_ME_{user}@127.0.0.1:{port}/0"  # noqa: E731
    worker = spawn_worker(url("worker"), "kvgate", *SIM, worker_id="acl-w", log=tmp_path / "worker.log")
    receiver, secret = Receiver().start(), new_secret()
    gw = start_gateway(url("gateway"), "kvgate", webhook_url=receiver.url, webhook_secret=secret,
                       webhook_allow_private=True, webhook_poll_s=0.1)
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key="none", max_retries=0, timeout=30)
        wait_for(lambda: client.models.list().data, timeout=60, what="the worker's model in /v1/models")
        out = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=3,
                                             messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
        # managed batches: create, lease, submit, record, finalize and list, all as the gateway user
        from tests.gateway.batch_files import jsonl, request, rows_of, wait_final

        f = client.files.create(file=("in.jsonl", jsonl([request(i) for i in range(5)])), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_final(client.batches.retrieve, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 5, done
        assert len(rows_of(client.files.content(done.output_file_id).content)) == 5
        assert [b.id for b in client.batches.list().data] == [batch.id]
        wait_for(lambda: receiver.deliveries, timeout=30, what="the batch.completed webhook")
        assert [(e.type, e.data.id) for e in receiver.events(secret)] == [("batch.completed", batch.id)]
        stats = subprocess.run([sys.executable, "-m", "kvgate.commands.cli", "stats", "--redis-url", url("monitor")],
                               capture_output=True, text=True, timeout=60)
        assert stats.returncode == 0 and "webhooks: delivered 1" in stats.stdout, stats.stdout + stats.stderr
        # the Responses API: a stored background response is written, read back while it runs and when done
        model = client.models.list().data[0].id
        queued = client.responses.create(model=model, input="hi", max_output_tokens=3, background=True)
        final = wait_for(lambda: (r := client.responses.retrieve(queued.id)).status in ("completed", "incomplete")
                         and r, timeout=60, what="the background response to end")
        assert final.usage.output_tokens == 3 and final.output_text
    finally:
        gw.stop()
        stop_worker(worker)
        receiver.stop()


def test_workers_and_gateways_list_models_in_the_model_set_and_producers_and_the_monitor_only_read_it(acl_server):
    keys, producer, worker, monitor = Keys("kvgate"), acl_server("producer"), acl_server("worker"), acl_server("monitor")
    acl_server("gateway").sadd(keys.models(), "org/m")
    worker.sadd(keys.models(), "alpha")
    assert producer.smembers(keys.models()) == monitor.smembers(keys.models()) == {b"org/m", b"alpha"}
    assert denied(lambda: producer.sadd(keys.models(), "typo"))  # a submit never makes a model known (issue 26.4)
    producer.xadd(keys.jobs("org/m", "high"), {"p": b"job"})
    assert denied(lambda: producer.sadd(keys.dead(), "x"))
    assert denied(lambda: monitor.sadd(keys.models(), "x"))
    assert denied(lambda: acl_server("keda").smembers(keys.models()))


def test_producer_and_gateway_users_read_a_waiting_jobs_status(acl_server):
    """A job's status reads its result keys in one MGET (its entry's state comes from a script that may not read job
    payloads): the gateway does so for a background response still running, and failed with NoPermissionError
    whenever the worker had not answered by the first retrieve."""
    from kvgate.producer.client import Client

    port = acl_server("monitor").connection_pool.connection_kwargs["port"]
    for user in ("producer", "gateway"):
        with Client(f"redis://{user}:CHANGE_ME_{user}@127.0.0.1:{port}/0", namespace="kvgate") as client:
            handle = client.submit("nobody serves this yet")
            assert handle.status().state == "queued" and client.status(handle.job_id).state == "queued"


def test_fair_share_serves_rings_and_sweeps_under_the_least_privilege_users(acl_server):
    """Fair share's whole path as the worker and producer users: the enqueue scripts (backlog, streams index, bell),
    the read, the idle worker's wait on the bells, and the pruning pass deleting the tenant's emptied stream."""
    import threading
    import time

    from kvgate.engine.simulated import SimulatedEngine
    from kvgate.producer.client import Client
    from kvgate.worker.settings import WorkerSettings
    from kvgate.worker.worker import Worker

    keys, monitor = Keys("kvgate"), acl_server("monitor")
    port = monitor.connection_pool.connection_kwargs["port"]
    url = lambda user: f"redis://{user}:CHANGE_ME_{user}@127.0.0.1:{port}/0"
    settings = WorkerSettings(redis_url=url("worker"), namespace="kvgate", worker_id="acl-fair", fair_share="on",
                              reclaim_idle_ms=200, trim_interval_s=0.1, heartbeat_interval_s=0.1)
    worker = Worker(SimulatedEngine(256, step_overhead_s=0.001, per_token_s=0.0), settings)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    stream = Keys.tenant_jobs(keys.jobs(None, "normal"), "acme")
    try:
        deadline = time.monotonic() + 10
        while not monitor.get(keys.fair()) and time.monotonic() < deadline:
            time.sleep(0.05)
        with Client(url("producer"), namespace="kvgate", tenant="acme") as client:
            handles = [client.submit("hi", max_tokens=4), client.submit("hi", max_tokens=4, idempotency_key="k")]
            assert [h.result(timeout=20).status for h in handles] == ["done"] * 2
        def exists() -> bool:
            try:
                return bool(monitor.xinfo_groups(stream) is not None)
            except redis.ResponseError as e:
                assert "no such key" in str(e)
                return False

        while exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not exists(), "the tenant's emptied stream was not deleted"
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(20)
    assert not thread.is_alive()
