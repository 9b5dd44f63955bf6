"""deploy/k8s/cluster/ and `render_models.py --cluster-shards`: KEDA's redis-cluster-streams triggers watch exactly the
shard streams workers read on a Redis Cluster, through the nodes the workers' URL names, with each shard's lagCount
scaled so that the largest trigger adds a pod at about the single stream's backlog."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from redis.crc import key_slot

from kvgate.producer.cluster import parse_cluster_url
from kvgate.producer.keys import PRIORITIES, Keys
from tests.deploy.test_render_models import _module, _render

DEPLOY = Path(__file__).parents[2] / "deploy/k8s"


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(*argv: str) -> subprocess.CompletedProcess:
    return _render(*argv)


def single_lag() -> dict[str, int]:
    scaled = next(d for d in docs(DEPLOY / "keda-scaledobject.yaml") if d["kind"] == "ScaledObject")
    return {t["metadata"]["stream"].rsplit(":", 1)[-1]: int(t["metadata"]["lagCount"]) for t in scaled["spec"]["triggers"]
            if t["type"] == "redis-streams"}


def test_the_cluster_scaled_object_watches_every_shard_stream_of_the_default_model_through_the_workers_nodes():
    url = parse_cluster_url(docs(DEPLOY / "cluster/redis-secret.example.yaml")[0]["stringData"]["worker-url"])
    auth, scaled = docs(DEPLOY / "cluster/keda-scaledobject.yaml")
    assert auth["kind"] == "TriggerAuthentication" and scaled["kind"] == "ScaledObject"
    keys = Keys("kvgate", url.shards, cluster=True)
    streams = []
    work = [t["name"] for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    assert work == ["work-deadline", "work-work", "work-wake"]  # every shard's work, summed by the exporter
    for trigger in [t for t in scaled["spec"]["triggers"] if t["type"] != "prometheus"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-cluster-streams" and meta["consumerGroup"] == Keys.GROUP
        assert all(isinstance(v, str) for v in meta.values())  # KEDA metadata is a string map
        assert tuple((h, int(p)) for h, p in (a.rsplit(":", 1) for a in meta["addresses"].split(","))) == url.nodes
        assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"] and meta["activationLagCount"] == "1"
        streams.append(meta["stream"])
    assert sorted(streams) == sorted(keys.served_jobs(["default"]))  # what a worker reads, every shard
    assert scaled["spec"]["minReplicaCount"] == 0 and scaled["spec"]["scaleTargetRef"]["name"] == "kvgate-worker"
    # the file is what render_models renders (hash tags are never typed by hand)
    assert scaled == _module().default_cluster_scaled_object("kvgate", url.shards, ",".join(
        f"{h}:{p}" for h, p in url.nodes))


def test_render_models_gives_each_model_one_trigger_per_shard_and_priority_in_that_shards_slot():
    done = render("Qwen/Qwen2.5-7B-Instruct=/models/qwen", "--alias", "Qwen/Qwen2.5-7B-Instruct=qwen",
                  "--namespace", "prod", "--cluster-shards", "4", "--cluster-addresses", "r0:7000,r1:7001")
    assert done.returncode == 0, done.stderr
    scaled = next(d for d in yaml.safe_load_all(done.stdout) if d["kind"] == "ScaledObject")
    keys, lag = Keys("prod", 4, cluster=True), single_lag()
    triggers = [t for t in scaled["spec"]["triggers"] if t["type"] != "prometheus"]
    lags = [t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    assert len(lags) == 3  # the work triggers over both names: the exporter sums the shards
    assert len(triggers) == 2 * len(PRIORITIES) * 4  # two names served
    assert sorted(t["metadata"]["stream"] for t in triggers) == sorted(keys.served_jobs(["Qwen/Qwen2.5-7B-Instruct",
                                                                                         "qwen"]))
    for t in triggers:
        stream, meta = t["metadata"]["stream"], t["metadata"]
        shard = keys.of_stream(stream)
        assert key_slot(stream.encode()) == key_slot(shard.result("any-job").encode())  # the shard's one slot
        assert meta["addresses"] == "r0:7000,r1:7001" and t["type"] == "redis-cluster-streams"
        assert int(meta["lagCount"]) == max(1, round(lag[stream.rsplit(":", 1)[-1]] / 4))
    assert len({key_slot(t["metadata"]["stream"].encode()) for t in triggers}) == 4


def test_without_cluster_shards_the_triggers_stay_single_redis_streams():
    done = render("m=/w")
    scaled = next(d for d in yaml.safe_load_all(done.stdout) if d["kind"] == "ScaledObject")
    assert {t["type"] for t in scaled["spec"]["triggers"]} == {"redis-streams", "prometheus"}
    streams = [t["metadata"]["stream"] for t in scaled["spec"]["triggers"] if t["type"] == "redis-streams"]
    assert streams == Keys("kvgate").all_jobs("m")


@pytest.mark.parametrize("argv, message", [(["--cluster-shards", "5000"], "--cluster-shards 5000"),
                                           (["--cluster-shards", "-1"], "--cluster-shards -1"),
                                           (["--cluster-shards", "3", "--cluster-addresses", "r0"], "host:port")])
def test_a_bad_shard_count_or_address_is_one_line_and_exit_2(argv, message):
    done = render("m=/w", *argv)
    assert done.returncode == 2 and message in done.stderr and done.stdout == ""
