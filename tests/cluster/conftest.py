"""A Redis Cluster of 3 primaries and 3 replicas on loopback ports (tests.support.ClusterGroup), shared by the tests
of this folder, each on its own namespace; tests that kill nodes start their own."""
from __future__ import annotations

import shutil

import pytest

from tests.support import FSYNC_EVERYSEC, ClusterGroup, redis_major, redis_server_binary


def cluster_or_skip() -> None:
    if not shutil.which("redis-cli"):
        pytest.skip("the Redis Cluster tests need redis-cli on the PATH (redis-cli --cluster create)")
    if redis_major(redis_server_binary()) < 7:
        pytest.skip("the Redis Cluster tests need redis-server >= 7 on the PATH")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> ClusterGroup:
    cluster_or_skip()
    group = ClusterGroup(tmp_path_factory.mktemp("cluster"), extra_args=FSYNC_EVERYSEC)  # never killed
    try:
        yield group.start()
    finally:
        group.stop()


@pytest.fixture
def own_cluster(tmp_path) -> ClusterGroup:
    """A cluster for one test that kills its nodes."""
    cluster_or_skip()
    group = ClusterGroup(tmp_path / "cluster")
    try:
        yield group.start()
    finally:
        group.stop()
