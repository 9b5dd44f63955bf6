"""Gateway fixtures: `kvgate serve`'s app under uvicorn in a thread on a free loopback port, in front of
`kvgate worker --simulated` subprocesses on a real redis-server."""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from dataclasses import dataclass

import pytest
import redis

from kvgate.producer.keys import Keys
from tests.support import free_port, spawn_worker

SIM = ("--simulated", "--sim-step-ms", "1", "--sim-per-token-ms", "0.01", "--max-num-seqs", "16")


@dataclass
class Gateway:
    base_url: str  # ends in /v1, as the openai client wants it
    server: object
    thread: threading.Thread

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "gateway did not stop"


def start_gateway(redis_url: str, namespace: str, **settings) -> Gateway:
    import uvicorn

    from kvgate.gateway import GatewaySettings, create_app

    settings.setdefault("files_dir", tempfile.mkdtemp(prefix="kvgate-files-"))  # never the user's data dir
    app = create_app(GatewaySettings(redis_url=redis_url, namespace=namespace, **settings))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True, name=f"gateway-{port}")
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"gateway on port {port} did not start")
        time.sleep(0.01)
    return Gateway(f"http://127.0.0.1:{port}/v1", server, thread)


def gateway_up(client) -> bool:
    """Whether a gateway answers an `openai` client's request (a subprocess gateway still starting does not)."""
    import openai

    try:
        client.models.list()
        return True
    except openai.APIConnectionError:
        return False


def wait_for_workers(redis_url: str, namespace: str, count: int = 1, timeout: float = 120.0,
                     proc=None) -> None:
    """Until `count` heartbeats are up: a worker that has one is reading jobs."""
    r, keys = redis.Redis.from_url(redis_url), Keys(namespace)
    deadline = time.monotonic() + timeout
    try:
        while r.zcard(keys.workers()) < count:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}: {proc.stdout.read()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {count} workers up after {timeout}s")
            time.sleep(0.05)
    finally:
        r.close()


def stop_worker(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except Exception:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_worker(redis_url: str, namespace: str, *args: str, worker_id: str, timeout: float = 120.0):
    """A `kvgate worker` subprocess with `args`, from its first heartbeat until the block ends; yields (url, ns)."""
    proc = spawn_worker(redis_url, namespace, *args, worker_id=worker_id)
    try:
        wait_for_workers(redis_url, namespace, timeout=timeout, proc=proc)
        yield redis_url, namespace
    finally:
        stop_worker(proc)


@pytest.fixture(scope="module")
def sim_fleet(shared_redis):
    """One simulated worker for a module, on its own namespace of the session's redis-server."""
    with running_worker(shared_redis.url, f"gw{os.getpid()}-{abs(hash(time.monotonic())) % 10**6}", *SIM,
                        worker_id="sim-gw") as fleet:
        yield fleet


@pytest.fixture(scope="module")
def gateway(sim_fleet):
    """An open gateway (no API key) in front of sim_fleet."""
    gw = start_gateway(*sim_fleet)
    yield gw
    gw.stop()


@pytest.fixture
def gateway_factory():
    """Factory for gateways with other settings, stopped at the end of the test."""
    started = []

    def start(redis_url: str, namespace: str, **settings) -> Gateway:
        gw = start_gateway(redis_url, namespace, **settings)
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()


@pytest.fixture(scope="package")
def smol(shared_redis):
    """The bundled SmolLM2-135M in a `kvgate worker` subprocess (CPU, ~15 s to load) behind a gateway, shared by the
    gateway tests that need a real model (test_smollm2, test_structured_outputs): the official client, with
    `.kvgate` = (redis url, namespace) for the SDK."""
    import openai

    with running_worker(shared_redis.url, f"gwsmol{os.getpid()}", "--model", "smollm2-135m", "--max-model-len",
                        "512", "--max-num-seqs", "4", worker_id="gw-smol", timeout=300) as (url, ns):
        gw = start_gateway(url, ns)
        client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=240)
        client.kvgate = (url, ns)
        try:
            yield client
        finally:
            client.close()
            gw.stop()

