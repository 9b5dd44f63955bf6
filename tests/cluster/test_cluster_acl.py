"""deploy/redis/acl-cluster.conf: rendered from acl.conf, and enough for each user on a real cluster: a worker serves,
a producer submits, streams and reads results, `kvgate stats` runs as monitor; a producer still cannot read the job
streams."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis

from kvgate.producer import Client
from kvgate.producer.redis_url import connect
from tests.cluster.conftest import cluster_or_skip
from tests.cluster.test_cluster_queue import SIM
from tests.reliability.chaos_harness import stop_all
from tests.support import ROOT, ClusterGroup, spawn_worker

sys.path.insert(0, str(ROOT / "deploy" / "redis"))
from cluster_acl import cluster_acl  # noqa: E402


def test_the_cluster_acl_file_is_rendered_from_acl_conf():
    text = (ROOT / "deploy/redis/acl-cluster.conf").read_text()
    assert text == cluster_acl((ROOT / "deploy/redis/acl.conf").read_text()), \
        "deploy/redis/acl-cluster.conf is stale: run python deploy/redis/cluster_acl.py"


@pytest.fixture
def acl_cluster(tmp_path):
    """A cluster made with the default user, then every node loads acl-cluster.conf (default user off)."""
    cluster_or_skip()
    acl = tmp_path / "users.acl"
    acl.write_text("user default on nopass ~* &* +@all\n")
    group = ClusterGroup(tmp_path / "cluster", extra_args=("--aclfile", str(acl)))
    try:
        group.start()
        acl.write_text((ROOT / "deploy/redis/acl-cluster.conf").read_text())
        for node in group.nodes:
            node.client().execute_command("ACL", "LOAD")
        yield group
    finally:
        group.stop()


def as_user(group: ClusterGroup, user: str) -> str:
    return group.url.replace("redis+cluster://", f"redis+cluster://{user}:CHANGE_ME_{user}@")


def test_each_user_does_its_job_on_a_cluster_and_no_more(acl_cluster, tmp_path):
    worker = spawn_worker(as_user(acl_cluster, "worker"), "kvgate", *SIM, worker_id="w0", log=tmp_path / "w.log")
    try:
        with Client(as_user(acl_cluster, "producer"), "kvgate") as client:
            handles = [client.submit(f"hello {i}", max_tokens=4) for i in range(12)]
            streamed = client.submit("stream", max_tokens=5, stream=True)
            assert [h.result(timeout=60).status for h in handles + [streamed]] == ["done"] * 13
            assert "".join(d.text for d in streamed.stream()) == streamed.result().text
            stream = client.keys.jobs(None, "normal", shard=0)
        out = subprocess.run([sys.executable, "-m", "kvgate.commands.cli", "stats", "--redis-url", as_user(acl_cluster, "monitor"),
                              "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["workers"]) == 1
        producer = connect(as_user(acl_cluster, "producer"))
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.xrange(stream)
        assert "NOPERM" not in (tmp_path / "w.log").read_text()
    finally:
        stop_all([worker])
