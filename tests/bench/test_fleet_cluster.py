"""W-FLEET's cluster contestant, tiny: one Redis and a 3-primary cluster each drain a small backlog of one-token jobs
with worker processes; every job is answered once on both, and each primary's Redis CPU is counted against the
jobs of the shards it holds."""
from __future__ import annotations

from argparse import Namespace

import pytest

from kvgate.bench.fleet_cluster import cluster_unavailable, compare, per_job, run_cluster
from kvgate.producer.keys import Keys


def _args(**kw) -> Namespace:
    base = dict(cluster_jobs=600, cluster_rounds=1, cluster_primaries=3, cluster_replicas=0, cluster_shards=0,
                procs=1, seed=0)
    return Namespace(**{**base, **kw})


def test_one_redis_and_a_three_primary_cluster_answer_every_job_once_and_count_cpu_per_primary():
    if why := cluster_unavailable():
        pytest.skip(why)
    r = run_cluster(_args())
    assert r["answered_once"]
    cluster, single = r["runs"]["cluster"][0], r["runs"]["single"][0]
    assert cluster["shards"] == 6 and single["shards"] == 1  # two shards per primary; one Redis has no shards
    assert len(cluster["per_node"]) == 3 and sum(n["jobs"] for n in cluster["per_node"].values()) == 600
    assert all(n["jobs"] > 100 for n in cluster["per_node"].values())  # the shards spread the jobs over every primary
    assert all(n["redis_cpu_s"] > 0 for n in cluster["per_node"].values()) and single["per_node"]
    assert set(r["ratio_per_primary"]) == set(cluster["per_node"]) and r["worst_ratio"] > 0
    assert r["single"]["jobs_per_s"][0] > 0 and all(v > 0 for v in r["cluster"]["jobs_per_s"])



def test_kvgate_bench_fleet_runs_the_cluster_contestant_alone_and_writes_its_json(tmp_path):
    if why := cluster_unavailable():
        pytest.skip(why)
    import argparse
    import json

    from kvgate.bench.fleet import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workers", "", "--throughput-jobs", "0", "--cluster-jobs", "300", "--procs", "1",
                              "--cluster-shards", "3", "--json", str(tmp_path / "w.json")])
    assert run(args) == 0
    result = json.loads((tmp_path / "w.json").read_text())
    assert result["answered_once"] and "p99_wait_s" not in result and result["runs"] == []
    assert result["cluster"]["cluster"]["shards"] == 3 and len(result["cluster"]["ratio_per_primary"]) == 3

def test_the_ratio_is_each_primarys_cpu_per_job_over_one_redis_and_a_job_answered_twice_fails():
    one = {"runs": [{"per_node": {1: {"jobs": 1000, "redis_cpu_s": 0.05}}, "jobs_per_s": 900.0,
                     "answered_once": True}]}
    many = {"runs": [{"per_node": {7: {"jobs": 500, "redis_cpu_s": 0.025}, 8: {"jobs": 250, "redis_cpu_s": 0.02},
                                   9: {"jobs": 250, "redis_cpu_s": 0.0125}},
                      "jobs_per_s": 800.0, "shards": 6, "answered_once": False}]}
    assert per_job(many["runs"])[8] == {"jobs": 250, "redis_cpu_s": 0.02, "cpu_us_per_job": 80.0}
    r = compare(one, many)
    assert r["ratio_per_primary"] == {7: 1.0, 8: 1.6, 9: 1.0}
    assert r["worst_ratio"] == 1.6 and not r["met"] and not r["answered_once"]


def test_the_finish_script_in_a_cluster_pipeline_costs_the_default_node_no_round_trip_per_job(tmp_path):
    if why := cluster_unavailable():
        pytest.skip(why)
    from kvgate.redis_cluster import ClusterGroup
    from kvgate.producer.cluster import connect_cluster, run_script

    group = ClusterGroup(tmp_path, primaries=3, replicas=0, extra_args=("--appendonly", "no")).start()
    try:
        client = connect_cluster(group.url)
        script = client.register_script("return redis.call('SET', KEYS[1], ARGV[1])")
        pipe = client.pipeline(transaction=False)
        for i in range(60):
            run_script(script, [f"job{{{i % 12}}}"], [i], pipe)
        assert len(pipe.execute()) == 60
        getkeys = sum(n.client().info("commandstats").get("cmdstat_command|getkeys", {}).get("calls", 0)
                      for n in group.nodes)
        assert getkeys == 0, f"{getkeys} COMMAND GETKEYS for 60 EVALSHA"
    finally:
        group.stop()


def test_a_workers_consumer_prune_on_a_cluster_costs_the_same_however_many_results_are_kept(tmp_path):
    if why := cluster_unavailable():
        pytest.skip(why)
    from kvgate.redis_cluster import ClusterGroup
    from kvgate.producer.redis_url import connect, keys_for
    from kvgate.worker.consumers import Consumers

    group = ClusterGroup(tmp_path, primaries=3, replicas=0, extra_args=("--appendonly", "no")).start()
    try:
        client = connect(group.url)
        keys = keys_for(group.url, client, "prune")
        streams = keys.served_jobs(["default"])
        for stream in streams:
            client.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
        consumers = Consumers(client, keys, "w0", streams, min_idle_ms=60_000)

        def scans_per_prune() -> int:
            for n in group.nodes:
                n.client().config_resetstat()
            consumers.prune()
            return sum(n.client().info("commandstats").get("cmdstat_scan", {}).get("calls", 0) for n in group.nodes)

        before = scans_per_prune()
        pipe = client.pipeline(transaction=False)
        for i in range(20_000):
            pipe.set(keys.result(f"job{i}"), b"x", ex=600)
        pipe.execute()
        assert scans_per_prune() == before, "the prune's SCAN grew with the results kept"
    finally:
        group.stop()
