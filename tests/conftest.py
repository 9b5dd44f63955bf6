"""Shared fixtures. Every Redis here is a real redis-server process on a random loopback port."""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import torch

from tests.support import free_port, redis_server_binary

# Triton reads this once, at its first import: set it before any test module can import triton, so the
# kernel tests run in the interpreter on a CPU-only machine whatever the collection order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass
class RedisServer:
    """A redis-server we own: restartable (same port, same data dir) and freezable, for fault injection."""

    workdir: Path
    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "", *self.extra_args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start")
                time.sleep(0.02)
        client.close()
        return self

    def stop(self, sig: int | None = None) -> None:
        if self.proc and self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kwargs)


@pytest.fixture
def redis_server(tmp_path) -> RedisServer:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory) -> RedisServer:
    """One server for a whole session, for tests that only need isolation by namespace."""
    server = RedisServer(tmp_path_factory.mktemp("redis-shared")).start()
    yield server
    server.stop()


@pytest.fixture
def namespace(request) -> str:
    return f"t{os.getpid()}-{abs(hash(request.node.nodeid)) % 10**8}"


def pytest_collection_modifyitems(config, items):
    """Heavy and GPU-only tests are skipped with a stated reason, never silently."""
    run_slow = os.environ.get("KVGATE_SLOW") == "1"
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow test: set KVGATE_SLOW=1 to run it"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none on this machine"))
