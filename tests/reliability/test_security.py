"""Access control, transport security and hostile-code hygiene.

Already proven in tests/deploy/test_redis_acl.py (not repeated here): deploy/redis/acl.conf loads into Redis 7;
the default user is off; a producer cannot XRANGE/XREAD/XREADGROUP the job stream, SCAN or KEYS, write the dead
stream, forge a reply or a result; the worker user can read, ack, publish, reclaim and heartbeat but not
administer; and the real SDK and Worker serve jobs as `user:pass@` URLs under those users.
Added here: requirepass and TLS through the URL for both the SDK and the worker, the ways a producer could
still try to find or read another client's replies under the ACL, unguessable names, no pickle/eval/exec in
project code, and the payload limit on both sides."""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import redis

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer import Client, ConnectionFailed, InvalidRequest
from kvgate.producer.client import check_client_id
from kvgate.producer.idempotency import owner_tag
from kvgate.producer.keys import PRIORITIES, Keys
from kvgate.producer.limits import MAX_PAYLOAD_BYTES
from kvgate.worker.settings import WorkerSettings
from kvgate.worker.worker import Worker
from tests.support import ROOT, RedisServer, free_port, redis_major

ACL = ROOT / "deploy/redis/acl.conf"
REDIS = shutil.which("redis-server")


def serve_jobs(worker_url: str, producer_url: str, ns: str = "kvgate", n: int = 3) -> list[str]:
    """A real Worker (thread) and a real Client, each given only its URL; returns the jobs' statuses."""
    settings = WorkerSettings(redis_url=worker_url, namespace=ns, worker_id="sec-w", heartbeat_interval_s=0.1)
    worker = Worker(SimulatedEngine(256, step_overhead_s=0.001, per_token_s=0.0), settings)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        with Client(producer_url, namespace=ns) as client:
            return [client.submit(f"hello {i}", max_tokens=4).result(timeout=20).status for i in range(n)]
    finally:
        stop.set()
        thread.join(20)


# ---- AUTH (requirepass) ------------------------------------------------------------------------------------
def test_requirepass_in_the_url_lets_the_sdk_and_worker_serve_and_a_wrong_one_is_refused_masked(tmp_path):
    server = RedisServer(tmp_path, extra_args=("--requirepass", "s3cret-pw")).start()
    port = server.port
    try:
        url = f"redis://:s3cret-pw@127.0.0.1:{port}/0"
        assert serve_jobs(url, url) == ["done"] * 3
        for bad in (f"redis://:wrong-pw@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
            with pytest.raises((ConnectionFailed, redis.AuthenticationError, redis.ResponseError)) as info:
                Client(bad)
            assert "wrong-pw" not in str(info.value) and "s3cret" not in str(info.value)
    finally:
        server.stop()


# ---- TLS ---------------------------------------------------------------------------------------------------
def tls_supported() -> str | None:
    """None when this redis-server can serve TLS, else why not."""
    if REDIS is None:
        return "no redis-server on PATH"
    if shutil.which("openssl") is None:
        return "no openssl to make test certificates"
    linked = subprocess.run(["ldd", REDIS], capture_output=True, text=True).stdout
    return None if "libssl" in linked else f"{REDIS} is built without TLS (not linked against libssl)"


def make_certs(d: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, made at test time."""
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvgate-test-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr")
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.crt")
    return {n: d / n for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


@pytest.mark.skipif(tls_supported() is not None, reason=str(tls_supported()))
def test_rediss_url_with_mutual_tls_serves_the_sdk_and_worker_and_unverified_peers_are_refused(tmp_path):
    certs = make_certs(tmp_path)
    port = free_port()
    query = f"ssl_ca_certs={certs['ca.crt']}&ssl_certfile={certs['client.crt']}&ssl_keyfile={certs['client.key']}"
    url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&{query}"
    tls = ("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs["server.crt"]),  # no plain TCP
           "--tls-key-file", str(certs["server.key"]), "--tls-ca-cert-file", str(certs["ca.crt"]),
           "--tls-auth-clients", "yes")
    server = RedisServer(tmp_path, binary=REDIS, port=port, extra_args=tls, url=url).start()
    try:
        assert serve_jobs(url, url) == ["done"] * 3
        plain = f"redis://127.0.0.1:{port}/0"
        no_client_cert = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={certs['ca.crt']}"
        unknown_ca = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&{query.replace('ca.crt', 'client.crt', 1)}"
        for refused in (plain, no_client_cert, unknown_ca):
            with pytest.raises(ConnectionFailed):
                Client(refused)
    finally:
        server.stop()


# ---- ACL: a producer cannot find or read another client's replies ------------------------------------------
@pytest.fixture
def acl(tmp_path):
    if redis_major(REDIS) < 7:
        pytest.skip("ACL selectors need redis-server >= 7 on PATH")
    shutil.copy(ACL, tmp_path / "acl.conf")
    server = RedisServer(tmp_path, binary=REDIS, extra_args=("--aclfile", str(tmp_path / "acl.conf"))).start()
    yield lambda user: f"redis://{user}:CHANGE_ME_{user}@127.0.0.1:{server.port}/0"
    server.stop()


def nopermission(call) -> bool:
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return True
    except redis.ResponseError as e:
        # inside a script the refusal reads "The user executing the script can't access/run ..."
        return any(w in str(e) for w in ("NOPERM", "no permissions", "user executing the script can't"))
    return False


def test_a_producer_cannot_discover_or_read_another_clients_reply_stream(acl):
    """Reply stream names are the secret; every way a producer might learn one, or reach the data behind the
    job stream (which names them all), is refused, including through a Lua script."""
    keys = Keys("kvgate")
    victim = Client(acl("producer"))
    try:
        victim.submit("private prompt", idempotency_key="order-42")
        attacker = redis.Redis.from_url(acl("producer"))
        stream = keys.jobs(None, "normal")
        refused = {
            "RANDOMKEY": lambda: attacker.randomkey(),
            "XINFO STREAM (first/last entry payloads)": lambda: attacker.xinfo_stream(stream),
            "XREVRANGE on jobs": lambda: attacker.xrevrange(stream),
            "EVAL XRANGE on jobs": lambda: attacker.eval("return redis.call('XRANGE', KEYS[1], '-', '+')", 1, stream),
            "EVAL SCAN": lambda: attacker.eval("return redis.call('SCAN', 0, 'MATCH', 'kvgate:reply:*')", 0),
            "MONITOR": lambda: attacker.execute_command("MONITOR"),
            "CLIENT LIST": lambda: attacker.client_list(),
            "SUBSCRIBE to keyspace events": lambda: attacker.execute_command("PSUBSCRIBE", "__key*__:*"),
            "CONFIG SET notify-keyspace-events": lambda: attacker.config_set("notify-keyspace-events", "KEA"),
            "DEBUG / OBJECT": lambda: attacker.object("encoding", stream),
            "XADD into the dead stream": lambda: attacker.xadd(keys.dead(), {"p": b"x"}),
        }
        allowed = [name for name, call in refused.items() if not nopermission(call)]
        assert allowed == [], f"a producer may {allowed}"
        claim = attacker.get(keys.idempotency("order-42")).decode()  # a guessable key names no reply stream
        assert victim.client_id not in claim and owner_tag(victim.client_id) in claim
    finally:
        victim.close()


def test_the_worker_user_serves_jobs_but_cannot_read_idempotency_claims_or_administer(acl):
    assert serve_jobs(acl("worker"), acl("producer")) == ["done"] * 3
    worker = redis.Redis.from_url(acl("worker"))
    assert nopermission(lambda: worker.get(Keys("kvgate").idempotency("order-42")))
    assert nopermission(lambda: worker.execute_command("MONITOR"))
    assert nopermission(lambda: worker.acl_list())


def test_an_idempotent_submit_is_allowed_under_the_producer_acl_and_a_script_still_cannot_read_jobs(acl):
    """The SDK claims an idempotency key and XADDs in one script; Redis 7 checks a script's declared keys against
    one selector (and flags them read-write), so acl.conf grants EVAL over {idem, jobs}; the commands inside a
    script are checked one by one, so that grants no XRANGE or XTRIM of the job stream."""
    with Client(acl("producer")) as client:
        first = client.submit("same body", idempotency_key="order-7")
        assert client.submit("same body", idempotency_key="order-7").job_id == first.job_id
    producer = redis.Redis.from_url(acl("producer"))
    stream = Keys("kvgate").jobs(None, "normal")
    script = "return redis.call('XRANGE', KEYS[2], '-', '+')"
    assert nopermission(lambda: producer.eval(script, 2, Keys("kvgate").idempotency("k"), stream))
    assert nopermission(lambda: producer.eval("return redis.call('XTRIM', KEYS[1], 'MAXLEN', 0)", 1, stream))


def test_the_sdk_reads_results_promptly_when_its_user_may_not_trim_or_expire_its_reply_stream(acl):
    """The producer user may read its reply stream, not write it: the reader must not treat the refused XTRIM
    as an outage and back off (up to 2 s a read) on every batch of results."""
    import time

    assert serve_jobs(acl("worker"), acl("producer"), n=1) == ["done"]  # warm: groups exist, script loaded
    started = time.monotonic()
    assert serve_jobs(acl("worker"), acl("producer"), n=8) == ["done"] * 8
    assert time.monotonic() - started < 4.0


# ---- names, code, limits -------------------------------------------------------------------------------------
def test_reply_stream_names_come_from_128_random_bits_and_short_or_glob_ids_are_refused(shared_redis, namespace):
    ids = []
    for _ in range(10):
        with Client(shared_redis.url, namespace) as client:
            ids.append(client.client_id)
    assert len(set(ids)) == 10 and all(len(i) >= 22 and re.fullmatch(r"[A-Za-z0-9_-]+", i) for i in ids)
    source = (ROOT / "producer/client_base.py").read_text()  # the one constructor both clients share
    assert source.count("secrets.token_urlsafe(16)") == 1  # 128 bits from the OS CSPRNG
    for weak in ("alice", "x" * 15, "has space" + "x" * 20, "glob*" + "x" * 20):
        with pytest.raises(ValueError, match="client_id"):
            check_client_id(weak)


UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}


def unsafe_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"import {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.Call):
            f, owner = node.func, getattr(getattr(node.func, "value", None), "id", "")
            if isinstance(f, ast.Name) and f.id in UNSAFE_CALLS:
                found.append(f"{f.id}()")
            if isinstance(f, ast.Attribute) and f.attr == "load" and owner in ("torch", "pickle", "yaml"):
                found.append(f"{owner}.load()")  # torch.load unpickles; yaml.load builds arbitrary objects
            if any(k.arg == "shell" and getattr(k.value, "value", False) is True for k in node.keywords):
                found.append("shell=True")
    return found


def test_project_code_has_no_pickle_eval_exec_or_unpickling_loads():
    files = [p for pkg in ("kvgate", "producer", "worker", "engine", "kernels")
             for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 30
    assert {str(p.relative_to(ROOT)): u for p in files if (u := unsafe_uses(p))} == {}


def test_the_unsafe_code_check_catches_each_pattern(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom marshal import loads\nimport torch, yaml, subprocess\neval('1')\n"
                   "exec('x=1')\ntorch.load('w.pt')\nyaml.load('a')\nsubprocess.run('ls', shell=True)\n"
                   "model.eval()\nredis.eval('return 1', 0)\n")
    assert sorted(unsafe_uses(bad)) == sorted(["import pickle", "import marshal", "eval()", "exec()", "torch.load()",
                                               "yaml.load()", "shell=True"])


def test_the_payload_limit_holds_on_both_sides(shared_redis, namespace):
    """Fields each within their own limits but over 1 MiB encoded: the SDK refuses before enqueueing (the worker
    side of the same limit is the 'oversize payload' case of test_bad_input)."""
    with Client(shared_redis.url, namespace) as client:
        with pytest.raises(InvalidRequest) as info:
            client.submit(prompt_token_ids=[2**31 - 1] * 300_000, max_tokens=1)
        assert info.value.field == "request" and str(MAX_PAYLOAD_BYTES) in str(info.value)
        r = shared_redis.client()
        assert sum(r.xlen(client.keys.jobs(None, p)) for p in PRIORITIES) == 0
