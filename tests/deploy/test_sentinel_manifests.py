"""deploy/k8s/sentinel/: the Sentinel variant scales on the same streams through the same sentinels and primary
the workers' redis+sentinel:// URL names."""
from __future__ import annotations

from pathlib import Path

import yaml

from kvgate.producer.keys import Keys
from kvgate.producer.redis_url import parse_sentinel_url

SENTINEL = Path(__file__).parents[2] / "deploy/k8s/sentinel"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((SENTINEL / name).read_text()) if d]


def test_keda_reads_the_lag_of_every_job_stream_from_the_primary_the_worker_url_names():
    secret = docs("redis-secret.example.yaml")[0]["stringData"]
    urls = [parse_sentinel_url(secret[k]) for k in ("worker-url", "monitor-url")]
    auth, scaled = docs("keda-scaledobject.yaml")
    assert auth["kind"] == "TriggerAuthentication" and scaled["kind"] == "ScaledObject"
    streams = set()
    plain = next(d for d in yaml.safe_load_all((SENTINEL.parent / "keda-scaledobject.yaml").read_text())
                 if d and d["kind"] == "ScaledObject")
    prometheus = [t for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
    assert prometheus == [t for t in plain["spec"]["triggers"] if t["type"] == "prometheus"]  # scaling on work
    assert {k: v for k, v in scaled["spec"].items() if k != "triggers"} == \
        {k: v for k, v in plain["spec"].items() if k != "triggers"}
    for trigger in [t for t in scaled["spec"]["triggers"] if t["type"] != "prometheus"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-sentinel-streams" and meta["consumerGroup"] == Keys.GROUP
        assert all(isinstance(v, str) for v in meta.values())  # KEDA metadata is a string map
        addresses = tuple((h, int(p)) for h, p in (a.rsplit(":", 1) for a in meta["addresses"].split(",")))
        assert all((u.sentinels, u.service) == (addresses, meta["sentinelMaster"]) for u in urls)
        assert int(meta["lagCount"]) > 0 and trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
        assert meta["activationLagCount"] == "1"  # KEDA 2.16 refuses "0" (kedacore/keda#6478)
        streams.add(meta["stream"])
    assert streams == set(Keys("kvgate").all_jobs(None))  # the default model; render_models.py shows one per model
    assert scaled["spec"]["minReplicaCount"] == 0 and scaled["spec"]["scaleTargetRef"]["name"] == "kvgate-worker"
