"""deploy/: every manifest parses and carries what its kind needs; alerts pass promtool; compose is whole."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from producer.protocol import Keys

DEPLOY = Path(__file__).parents[2] / "deploy"
K8S = DEPLOY / "k8s"


def k8s_docs() -> list[dict]:
    return [d for path in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]


def of_kind(kind: str) -> list[dict]:
    return [d for d in k8s_docs() if d["kind"] == kind]


def named(kind: str, name: str) -> dict:
    return next(d for d in of_kind(kind) if d["metadata"]["name"] == name)


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_every_k8s_document_has_api_version_kind_and_name():
    docs = k8s_docs()
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Service", "ConfigMap", "ScaledObject",
                                         "TriggerAuthentication", "PodMonitor", "ServiceMonitor", "PrometheusRule"}
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"], d


def test_builtin_kinds_validate_against_the_kubernetes_openapi_schema():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate for schema checks")
    checked = 0
    for d in k8s_docs():
        try:
            kv.validate(d, "1.30", strict=True)
            checked += 1
        except kv.SchemaNotFoundError:  # CRDs (KEDA, Prometheus Operator) are checked field by field below
            assert d["apiVersion"].split("/")[0] in ("keda.sh", "monitoring.coreos.com"), d["kind"]
    assert checked >= 6


@pytest.mark.parametrize("kind", ["Deployment", "StatefulSet"])
def test_workload_selectors_match_their_pod_labels_and_containers_have_images(kind):
    for d in of_kind(kind):
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for c in d["spec"]["template"]["spec"]["containers"]:
            assert c["image"] and c["resources"]["requests"]


def test_worker_requests_a_gpu_and_its_grace_period_covers_the_drain_timeout():
    spec = named("Deployment", "kvfleet-worker")["spec"]
    pod, = [spec["template"]["spec"]]
    worker = pod["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["requests"]["nvidia.com/gpu"] == "1"
    env = env_of(worker)
    assert {"KVFLEET_REDIS_URL", "KVFLEET_NAMESPACE", "KVFLEET_WORKER_ID", "KVFLEET_METRICS_PORT"} <= env.keys()
    drain = float(env["KVFLEET_DRAIN_TIMEOUT_S"])
    assert drain < pod["terminationGracePeriodSeconds"] <= drain + 60
    assert "replicas" not in spec  # KEDA owns the replica count
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert probe in worker
    metrics_port = int(env["KVFLEET_METRICS_PORT"])
    assert {"name": "metrics", "containerPort": metrics_port} in worker["ports"]
    assert worker["livenessProbe"]["httpGet"]["port"] == "metrics"


def test_readiness_probe_reads_the_heartbeat_key_the_worker_writes():
    probe = named("Deployment", "kvfleet-worker")["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    script = probe["exec"]["command"][-1]
    assert Keys("NS").worker("ID") == "NS:worker:ID"  # the probe builds the key the same way
    assert ':worker:{os.environ["KVFLEET_WORKER_ID"]}' in script and '"state"' in script
    compile(script, "readiness", "exec")


def test_redis_runs_with_append_only_persistence_and_no_eviction():
    conf = named("ConfigMap", "kvfleet-redis-config")["data"]["redis.conf"]
    assert "appendonly yes" in conf and "maxmemory-policy noeviction" in conf
    sts = named("StatefulSet", "kvfleet-redis")
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_keda_scales_the_worker_to_zero_on_lag_of_every_job_stream():
    so = named("ScaledObject", "kvfleet-worker")["spec"]
    assert so["scaleTargetRef"]["name"] == "kvfleet-worker" and so["minReplicaCount"] == 0
    assert so["maxReplicaCount"] >= 1
    keys = Keys("kvfleet")
    streams = set()
    for trigger in so["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams" and meta["consumerGroup"] == Keys.GROUP
        assert int(meta["lagCount"]) > 0 and int(meta["activationLagCount"]) >= 0
        assert all(isinstance(v, str) for v in meta.values())  # KEDA metadata is a string map
        assert trigger["authenticationRef"]["name"] in {d["metadata"]["name"] for d in of_kind("TriggerAuthentication")}
        streams.add(meta["stream"])
    assert streams == set(keys.all_jobs())


def test_pod_and_service_monitors_select_the_worker_and_exporter_ports():
    worker = named("Deployment", "kvfleet-worker")["spec"]["template"]
    pm = named("PodMonitor", "kvfleet-worker")["spec"]
    assert pm["selector"]["matchLabels"].items() <= worker["metadata"]["labels"].items()
    assert pm["podMetricsEndpoints"][0]["port"] in {p["name"] for p in worker["spec"]["containers"][0]["ports"]}
    svc = named("Service", "kvfleet-exporter")
    sm = named("ServiceMonitor", "kvfleet-exporter")["spec"]
    assert sm["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}


def test_prometheus_rule_carries_exactly_the_alerts_file():
    alerts = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    assert named("PrometheusRule", "kvfleet")["spec"]["groups"] == alerts["groups"]
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"]}
    assert {"KvfleetBacklogGrowing", "KvfleetOldestJobTooOld", "KvfleetDeadLetters", "KvfleetNoLiveWorkers"} <= names


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (apt-get install prometheus ships it)")
def test_alert_rules_pass_promtool_check_rules(tmp_path):
    rule = tmp_path / "prometheusrule.yml"
    rule.write_text(yaml.safe_dump({"groups": named("PrometheusRule", "kvfleet")["spec"]["groups"]}))
    for path in (DEPLOY / "prometheus/alerts.yml", rule):
        done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (apt-get install prometheus ships it)")
def test_no_live_workers_alert_fires_only_with_jobs_waiting(tmp_path):
    """promtool's rule unit tests: zero workers while idle is scale-to-zero, not an outage."""
    (tmp_path / "alerts.yml").write_text((DEPLOY / "prometheus/alerts.yml").read_text())
    series = lambda name, lbl, values: {"series": f"{name}{{kvfleet_namespace=\"kvfleet\"{lbl}}}", "values": values}
    case = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [series("kvfleet_live_workers", "", "0x30"),
                         series("kvfleet_queue_lag", ',priority="normal"', "0x10 5x20"),
                         series("kvfleet_queue_pending", ',priority="normal"', "0x30"),
                         series("kvfleet_exporter_redis_up", "", "1x30")],
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "KvfleetNoLiveWorkers", "exp_alerts": []},
            {"eval_time": "25m", "alertname": "KvfleetNoLiveWorkers",
             "exp_alerts": [{"exp_labels": {"severity": "critical", "kvfleet_namespace": "kvfleet"},
                             "exp_annotations": {"summary": "kvfleet has jobs waiting and no live worker"}}]}]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(case))
    done = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_dashboard_has_the_backpressure_and_latency_panels():
    dash = json.loads((DEPLOY / "grafana/dashboards/kvfleet.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"]
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for needed in ("kvfleet_queue_lag", "kvfleet_jobs_admitted_total", "kvfleet_jobs_finished_total",
                   "kvfleet_kv_cache_usage_ratio", "kvfleet_kv_free_blocks", "kvfleet_preemptions_total",
                   "kvfleet_redeliveries_total", "kvfleet_dead_letters_total"):
        assert needed in exprs
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert f"histogram_quantile(0.99, sum by (le) (rate(kvfleet_{hist}_seconds_bucket" in exprs
    for p in dash["panels"]:
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


def test_compose_stack_has_every_service_and_its_mounted_files_exist():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {"redis", "worker", "exporter", "prometheus", "grafana"} <= compose["services"].keys()
    for name, svc in compose["services"].items():
        assert "image" in svc or "build" in svc, name
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
    assert "--appendonly" in compose["services"]["redis"]["command"]
    prom = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"worker:9300", "exporter:9400"}
    assert compose["services"]["worker"]["environment"]["KVFLEET_METRICS_PORT"] == "9300"
    assert (DEPLOY / "Dockerfile").exists() and (DEPLOY / "README.md").exists()


def test_every_kvfleet_variable_in_deploy_is_a_setting_the_worker_reads():
    import re

    from worker.settings import WorkerSettings

    known = {f"KVFLEET_{name.upper()}" for name in WorkerSettings.model_fields}
    known |= {"KVFLEET_EXPORTER_PORT", "KVFLEET_EXPORTER_ADDR"}  # read by `kvfleet exporter`
    used = set()
    for path in [*K8S.glob("*.yaml"), DEPLOY / "compose.yaml"]:
        used |= set(re.findall(r"\bKVFLEET_[A-Z0-9_]+", path.read_text()))
    assert used and not used - known, f"unknown settings: {sorted(used - known)}"
