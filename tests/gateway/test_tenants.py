"""Tenants (issue 26.2): a namespace's files are its own, an API key is a tenant's, and a tenant sees only its own
files, batches and jobs; the admin key sees every tenant's."""
from __future__ import annotations

import contextlib
import threading
import time

import httpx
import msgspec
import openai
import pytest
import redis

from kvgate.producer import Client, InvalidRequest
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD, ProtocolError, decode_job
from kvgate.gateway.batches.file_store import namespace_dir
from kvgate.producer.submission import prepare
from tests.gateway.batch_files import CHAT, jsonl, request, rows_of, wait_final
from tests.gateway.conftest import SIM, stop_worker, wait_for_workers
from tests.support import free_port, spawn_worker, wait_for

KEYS_FILE = """# kvgate API keys: KEY=TENANT, one a line
sk-alpha-0001 = team-a

sk-beta-0002=team-b
"""
ADMIN = "sk-root-0003"


def openai_client(gw, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0, timeout=60)


def outcome(call) -> int:
    """The HTTP status a call of the openai client got: 200 when it returned."""
    try:
        call()
        return 200
    except openai.APIStatusError as e:
        assert e.status_code != 404 or set(e.body) == {"message", "type", "param", "code"}, e.body  # OpenAI's shape
        return e.status_code


def run_batch(c: openai.OpenAI, n: int = 4):
    f = c.files.create(file=("in.jsonl", jsonl([request(i) for i in range(n)])), purpose="batch")
    done = wait_final(c.batches.retrieve, c.batches.create(input_file_id=f.id, endpoint=CHAT,
                                                            completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.completed == n, done
    return f, done


def test_two_namespaces_on_the_default_files_directory_reach_none_of_each_others_files(
        sim_fleet, shared_redis, gateway_factory, tmp_path, monkeypatch):
    """Team B's gateway serves the fleet's namespace, team A's another one; both keep files where the default
    says. Before: A listed B's file, read its input and output, started a batch on it and deleted it (5/5)."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    team_b = gateway_factory(*sim_fleet, files_dir=None, batch_poll_s=0.2)
    team_a = gateway_factory(shared_redis.url, f"{sim_fleet[1]}-a", files_dir=None, batch_poll_s=0.2)
    with openai_client(team_b, "unused") as b, openai_client(team_a, "unused") as a:
        f, done = run_batch(b)
        accesses = {
            "list": lambda: f.id in [x.id for x in a.files.list()] or _refused(),
            "read input": lambda: a.files.content(f.id),
            "read output": lambda: a.files.content(done.output_file_id),
            "start a batch": lambda: a.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h"),
            "delete": lambda: a.files.delete(f.id),
        }
        got = {name: outcome(call) for name, call in accesses.items()}
        assert got == {name: 404 for name in accesses}, got
        assert rows_of(b.files.content(f.id).content) == [request(i) for i in range(4)]  # B's file is whole
        assert len(rows_of(b.files.content(done.output_file_id).content)) == 4
        assert f.id in [x.id for x in b.files.list()] and a.files.list().data == []


def _refused():
    """A listing without the file counts as the 404 a direct access gets."""
    raise openai.NotFoundError("not listed", response=httpx.Response(404, request=httpx.Request("GET", "http://x")),
                               body={"message": "not listed", "type": "x", "param": None, "code": "not_listed"})


@pytest.fixture
def tenant_gateway(sim_fleet, gateway_factory, tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text(KEYS_FILE)
    return gateway_factory(*sim_fleet, files_dir=str(tmp_path / "files"), api_keys_file=str(keys),
                           api_keys=["sk-gamma-0004=team-c", "sk-bare-0005"], admin_keys=[ADMIN], batch_poll_s=0.2)


def test_a_tenant_gets_404_for_every_file_and_batch_of_another_and_lists_only_its_own(tenant_gateway):
    with openai_client(tenant_gateway, "sk-alpha-0001") as a, openai_client(tenant_gateway, "sk-beta-0002") as b:
        f, done = run_batch(a)
        own_file, own_batch = run_batch(b, 2)
        accesses = {
            "retrieve file": lambda: b.files.retrieve(f.id),
            "read input": lambda: b.files.content(f.id),
            "read output": lambda: b.files.content(done.output_file_id),
            "output metadata": lambda: b.files.retrieve(done.output_file_id),
            "delete file": lambda: b.files.delete(f.id),
            "start a batch": lambda: b.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h"),
            "retrieve batch": lambda: b.batches.retrieve(done.id),
            "cancel batch": lambda: b.batches.cancel(done.id),
        }
        got = {name: outcome(call) for name, call in accesses.items()}
        assert got == {name: 404 for name in accesses}, got
        assert sorted(x.id for x in b.files.list()) == sorted([own_batch.output_file_id, own_file.id])
        page = b.batches.list(limit=1)
        assert [x.id for x in page.data] == [own_batch.id] and not page.has_more
        assert sorted(x.id for x in a.files.list()) == sorted([f.id, done.output_file_id])
        assert [x.id for x in a.batches.list()] == [done.id]
        assert a.files.retrieve(f.id).id == f.id and a.batches.retrieve(done.id).status == "completed"


def test_the_admin_key_sees_every_tenants_files_and_batches(tenant_gateway):
    with openai_client(tenant_gateway, "sk-alpha-0001") as a, openai_client(tenant_gateway, "sk-beta-0002") as b, \
            openai_client(tenant_gateway, ADMIN) as admin:
        fa, da = run_batch(a, 2)
        fb, db = run_batch(b, 2)
        assert {fa.id, fb.id, da.output_file_id, db.output_file_id} <= {x.id for x in admin.files.list()}
        assert {da.id, db.id} <= {x.id for x in admin.batches.list()}
        assert len(rows_of(admin.files.content(db.output_file_id).content)) == 2
        assert admin.batches.retrieve(da.id).id == da.id
        # an admin's batch on a tenant's file is that tenant's: it shows in the tenant's list
        started = admin.batches.create(input_file_id=fb.id, endpoint=CHAT, completion_window="24h")
        assert started.id in [x.id for x in b.batches.list()] and started.id not in [x.id for x in a.batches.list()]
        wait_final(b.batches.retrieve, started.id)


def test_keys_given_as_flags_map_to_their_tenant_and_a_bare_key_to_default(tenant_gateway):
    with openai_client(tenant_gateway, "sk-gamma-0004") as c, openai_client(tenant_gateway, "sk-bare-0005") as d, \
            openai_client(tenant_gateway, "sk-alpha-0001") as a:
        f = c.files.create(file=("c.jsonl", jsonl([request(0)])), purpose="batch")
        g = d.files.create(file=("d.jsonl", jsonl([request(0)])), purpose="batch")
        assert [x.id for x in c.files.list()] == [f.id] and [x.id for x in d.files.list()] == [g.id]
        assert outcome(lambda: a.files.retrieve(f.id)) == outcome(lambda: c.files.retrieve(g.id)) == 404
        with pytest.raises(openai.AuthenticationError) as e:
            openai_client(tenant_gateway, "sk-alpha-0009").files.list()
        assert "sk-" not in str(e.value.body) and "0009" not in str(e.value.body)  # a key never shows in errors


def jobs_of(url: str, stream: str, n: int) -> list:
    with redis.Redis.from_url(url) as r:
        wait_for(lambda: r.xlen(stream) >= n, 30, f"{n} jobs in {stream}")
        return [decode_job(fields[FIELD.encode()]) for _, fields in r.xrange(stream)]


def test_jobs_carry_their_tenant_from_the_api_key_and_from_a_batchs_owner(shared_redis, namespace, gateway_factory,
                                                                          tmp_path):
    """No worker: the jobs stay in their streams, to be read as a worker would decode them."""
    gw = gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), models=["m"],
                         api_keys=["sk-alpha-0001=team-a", "sk-beta-0002=team-b"], batch_poll_s=0.2)
    keys = Keys(namespace)

    def chat():  # gives up after 2 s; the gateway cancels the job, which stays in the stream
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(f"{gw.base_url}/chat/completions", timeout=2, headers={"authorization": "Bearer sk-alpha-0001"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})

    waiter = threading.Thread(target=chat)
    waiter.start()
    [job] = jobs_of(shared_redis.url, keys.jobs("m", "normal"), 1)
    waiter.join()
    assert job.tenant == "team-a"
    with openai_client(gw, "sk-beta-0002") as b:
        rows = [{**request(i), "body": {**request(i)["body"], "model": "m"}} for i in range(3)]
        f = b.files.create(file=("m.jsonl", jsonl(rows)), purpose="batch")
        batch = b.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        batch_jobs = jobs_of(shared_redis.url, keys.jobs("m", "low"), 3)
        assert [j.tenant for j in batch_jobs] == ["team-b"] * 3
        b.batches.cancel(batch.id)


def test_a_worker_serves_jobs_with_and_without_a_tenant_and_counts_them_by_tenant(shared_redis, namespace,
                                                                                  gateway_factory, tmp_path):
    """The worker's view: its metrics count each finished job under the tenant it decoded."""
    port = free_port()
    proc = spawn_worker(shared_redis.url, namespace, *SIM, "--metrics-port", str(port), worker_id="sim-tenants")
    try:
        wait_for_workers(shared_redis.url, namespace, proc=proc)
        gw = gateway_factory(shared_redis.url, namespace, files_dir=str(tmp_path), api_keys=["sk-alpha-0001=team-a"])
        with Client(shared_redis.url, namespace) as old, Client(shared_redis.url, namespace, tenant="team-x") as new:
            before = old.submit("an old producer's job", max_tokens=3, model="simulated")
            after = new.submit("a tenant's job", max_tokens=3, model="simulated")
            assert before.result(60).status == after.result(60).status == "done"
        with openai_client(gw, "sk-alpha-0001") as a:
            a.chat.completions.create(model="simulated", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        def counted(tenant: str) -> str:
            return (f'kvgate_tenant_jobs_finished_total{{model="simulated",status="done",tenant="{tenant}",'
                    'worker="sim-tenants"} 1.0')

        wait_for(lambda: all(counted(t) in metrics_text(port) for t in ("_none", "team-x", "team-a")), 30,
                 "the three jobs counted by tenant")
    finally:
        stop_worker(proc)
    keys = Keys(namespace)
    without = prepare({"prompt": "x"}, keys, "c" * 16).payload
    assert "tenant" not in msgspec.msgpack.decode(without)  # what an old producer sends: no field at all
    assert msgspec.msgpack.decode(prepare({"prompt": "x", "tenant": "team-x"}, keys, "c" * 16).payload)["tenant"] \
        == "team-x"


def metrics_text(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def test_a_tenant_name_is_checked_where_it_is_given_and_where_it_is_decoded():
    with pytest.raises(ValueError, match="tenant"):
        Client("redis://127.0.0.1:1", tenant="team a")
    with pytest.raises(InvalidRequest, match="tenant"):
        prepare({"prompt": "x", "tenant": "{team}"}, Keys(), "c" * 16)
    job = {"v": 1, "job_id": "j1", "client_id": "c" * 16, "enqueued_at": time.time(), "prompt": "x"}
    assert decode_job(msgspec.msgpack.encode(job)).tenant is None  # a job from before tenants
    assert decode_job(msgspec.msgpack.encode({**job, "tenant": "team-a"})).tenant == "team-a"
    for bad in ("", "team a", "{x}", "t" * 65):
        with pytest.raises(ProtocolError, match="tenant"):
            decode_job(msgspec.msgpack.encode({**job, "tenant": bad}))


def test_bad_key_entries_are_refused_at_start_without_showing_the_key(tmp_path):
    from kvgate.gateway import GatewaySettings

    keys = tmp_path / "keys"
    keys.write_text("sk-good-0001=team-a\nsk-secret-9999=bad tenant\n")
    with pytest.raises(ValueError, match=r"line 2") as e:
        GatewaySettings(api_keys_file=str(keys))
    assert "sk-secret" not in str(e.value) and "9999" not in str(e.value)
    with pytest.raises(ValueError, match="two tenants") as e:
        GatewaySettings(api_keys=["sk-twice-7777=team-a", "sk-twice-7777=team-b"])
    assert "7777" not in str(e.value)
    with pytest.raises(ValueError, match="no such file"):
        GatewaySettings(api_keys_file=str(tmp_path / "missing"))
    from tests.gateway.test_serve_command import serve_settings

    with pytest.raises(ValueError) as e:
        serve_settings("--api-key", "sk-flag-4444 x", "--admin-key", "sk-admin-5555")
    assert "--api-key entry 1: an API key must be non-empty, printable, with no whitespace" in str(e.value)
    assert "4444" not in str(e.value) and "5555" not in str(e.value)
    with pytest.raises(ValueError, match="admin key must be a key of its own"):
        serve_settings("--api-key", "sk-same-6666=team-a", "--admin-key", "sk-same-6666")


@pytest.mark.parametrize("ns", ["..", ".", "a/../../b", "team-a"])
def test_each_namespace_has_a_folder_of_its_own_inside_the_files_directory(tmp_path, ns):
    folder = namespace_dir(tmp_path, ns)
    assert folder.parent == tmp_path and folder.name not in (".", "..") and "/" not in folder.name
    assert folder != namespace_dir(tmp_path, ns + "x")


def test_the_tenant_is_not_part_of_what_makes_two_submits_the_same_request():
    """A batch line resubmitted with its tenant (a replica upgraded mid-batch) reattaches to the job submitted
    without one, instead of failing on an idempotency conflict."""
    from kvgate.producer.request import validate_request

    same = {"prompt": "x", "idempotency_key": "batch_1-req-1"}
    assert validate_request(same).digest() == validate_request({**same, "tenant": "team-a"}).digest()
