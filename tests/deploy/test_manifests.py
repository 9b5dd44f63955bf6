"""deploy/: every manifest parses and carries what its kind needs; alerts pass promtool; compose is whole."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvgate.producer.keys import Keys

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
    spec = named("Deployment", "kvgate-worker")["spec"]
    pod, = [spec["template"]["spec"]]
    worker = pod["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["requests"]["nvidia.com/gpu"] == "1"
    env = env_of(worker)
    assert {"KVGATE_REDIS_URL", "KVGATE_NAMESPACE", "KVGATE_WORKER_ID", "KVGATE_METRICS_PORT"} <= env.keys()
    drain = float(env["KVGATE_DRAIN_TIMEOUT_S"])
    assert drain < pod["terminationGracePeriodSeconds"] <= drain + 60
    assert "replicas" not in spec  # KEDA owns the replica count
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert probe in worker
    metrics_port = int(env["KVGATE_METRICS_PORT"])
    assert {"name": "metrics", "containerPort": metrics_port} in worker["ports"]
    assert worker["livenessProbe"]["httpGet"]["port"] == "metrics"


def test_readiness_probe_reads_the_heartbeat_key_the_worker_writes():
    probe = named("Deployment", "kvgate-worker")["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    script = probe["exec"]["command"][-1]
    assert Keys("NS").worker("ID") == "NS:worker:ID"  # the probe builds the key the same way
    assert ':worker:{os.environ["KVGATE_WORKER_ID"]}' in script and '"state"' in script
    compile(script, "readiness", "exec")


def test_redis_runs_with_append_only_persistence_and_no_eviction():
    conf = named("ConfigMap", "kvgate-redis-config")["data"]["redis.conf"]
    assert "appendonly yes" in conf and "maxmemory-policy noeviction" in conf
    sts = named("StatefulSet", "kvgate-redis")
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_keda_scales_the_worker_to_zero_on_lag_of_every_job_stream():
    so = named("ScaledObject", "kvgate-worker")["spec"]
    assert so["scaleTargetRef"]["name"] == "kvgate-worker" and so["minReplicaCount"] == 0
    assert so["maxReplicaCount"] >= 1
    keys = Keys("kvgate")
    streams = set()
    for trigger in [t for t in so["triggers"] if t["type"] != "prometheus"]:  # those: the next test
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams" and meta["consumerGroup"] == Keys.GROUP
        assert int(meta["lagCount"]) > 0 and int(meta["activationLagCount"]) >= 0
        assert all(isinstance(v, str) for v in meta.values())  # KEDA metadata is a string map
        assert trigger["authenticationRef"]["name"] in {d["metadata"]["name"] for d in of_kind("TriggerAuthentication")}
        streams.add(meta["stream"])
    assert streams == set(keys.all_jobs(None))


def test_keda_scales_on_the_exporters_work_and_wakes_on_one_job_of_any_stream():
    """Fair share and lanes put jobs in streams no redis-streams trigger names (nor can: one per tenant): the
    prometheus triggers read the exporter, whose gauges sum the shared stream, its lanes and the band's tenants'
    queued jobs. The wake trigger is 1 while any job waits (activationThreshold 0: one job wakes the fleet); the
    others size the fleet in workers (AverageValue over a worker's tokens/s)."""
    so = named("ScaledObject", "kvgate-worker")["spec"]
    prom = {t["name"]: t for t in so["triggers"] if t["type"] == "prometheus"}
    assert sorted(prom) == ["work-deadline", "work-wake", "work-work"]
    wake = prom["work-wake"]["metadata"]
    assert wake["query"] == 'clamp_max(sum(kvgate_queue_lag{kvgate_namespace="kvgate",served_by=~"default"}), 1)'
    assert (wake["threshold"], wake["activationThreshold"]) == ("1", "0")
    assert "kvgate_queue_deadline_tokens_per_second_needed" in prom["work-deadline"]["metadata"]["query"]
    assert "kvgate_queue_tokens_waiting" in prom["work-work"]["metadata"]["query"]
    for t in prom.values():
        assert t["metricType"] == "AverageValue" and t["metadata"]["serverAddress"].startswith("http://")
        assert all(isinstance(v, str) for v in t["metadata"].values())


def test_pod_and_service_monitors_select_the_worker_exporter_and_gateway_ports():
    worker = named("Deployment", "kvgate-worker")["spec"]["template"]
    pm = named("PodMonitor", "kvgate-worker")["spec"]
    assert pm["selector"]["matchLabels"].items() <= worker["metadata"]["labels"].items()
    assert pm["podMetricsEndpoints"][0]["port"] in {p["name"] for p in worker["spec"]["containers"][0]["ports"]}
    for name in ("kvgate-exporter", "kvgate-gateway"):  # the gateway's /metrics is on its API port
        svc = named("Service", name)
        sm = named("ServiceMonitor", name)["spec"]
        assert sm["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert sm["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}


def test_prometheus_rule_carries_exactly_the_alerts_file():
    alerts = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    assert named("PrometheusRule", "kvgate")["spec"]["groups"] == alerts["groups"]
    names = {r["alert"] for g in alerts["groups"] for r in g["rules"]}
    assert {"KvGateBacklogGrowing", "KvGateOldestJobTooOld", "KvGateDeadLetters", "KvGateNoLiveWorkers"} <= names


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (apt-get install prometheus ships it)")
def test_alert_rules_pass_promtool_check_rules(tmp_path):
    rule = tmp_path / "prometheusrule.yml"
    rule.write_text(yaml.safe_dump({"groups": named("PrometheusRule", "kvgate")["spec"]["groups"]}))
    for path in (DEPLOY / "prometheus/alerts.yml", rule):
        done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (apt-get install prometheus ships it)")
def test_no_live_workers_alert_fires_only_with_jobs_waiting(tmp_path):
    """promtool's rule unit tests: zero workers while idle is scale-to-zero, not an outage."""
    (tmp_path / "alerts.yml").write_text((DEPLOY / "prometheus/alerts.yml").read_text())
    series = lambda name, lbl, values: {"series": f"{name}{{kvgate_namespace=\"kvgate\"{lbl}}}", "values": values}
    case = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [series("kvgate_live_workers", "", "0x30"),
                         series("kvgate_queue_lag", ',priority="normal"', "0x10 5x20"),
                         series("kvgate_queue_pending", ',priority="normal"', "0x30"),
                         series("kvgate_exporter_redis_up", "", "1x30")],
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "KvGateNoLiveWorkers", "exp_alerts": []},
            {"eval_time": "25m", "alertname": "KvGateNoLiveWorkers",
             "exp_alerts": [{"exp_labels": {"severity": "critical", "kvgate_namespace": "kvgate"},
                             "exp_annotations": {"summary": "kvgate has jobs waiting and no live worker"}}]}]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(case))
    done = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_dashboard_has_the_backpressure_and_latency_panels():
    dash = json.loads((DEPLOY / "grafana/dashboards/kvgate.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"]
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for needed in ("kvgate_queue_lag", "kvgate_jobs_admitted_total", "kvgate_jobs_finished_total",
                   "kvgate_kv_cache_usage_ratio", "kvgate_kv_free_blocks", "kvgate_preemptions_total",
                   "kvgate_redeliveries_total", "kvgate_dead_letters_total"):
        assert needed in exprs
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert f"histogram_quantile(0.99, sum by (le) (rate(kvgate_{hist}_seconds_bucket" in exprs
    for p in dash["panels"]:
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


def test_compose_stack_has_every_service_and_its_mounted_files_exist():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {"redis", "worker", "gateway", "exporter", "prometheus", "grafana"} <= compose["services"].keys()
    assert compose["services"]["gateway"]["environment"]["KVGATE_REDIS_URL"].startswith("redis://gateway:")
    for name, svc in compose["services"].items():
        assert "image" in svc or "build" in svc, name
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
    assert "--appendonly" in compose["services"]["redis"]["command"]
    prom = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"worker:9300", "exporter:9400", "gateway:8000"}
    assert "8000:8000" in compose["services"]["gateway"]["ports"]  # its GET /metrics is on its API port
    assert compose["services"]["worker"]["environment"]["KVGATE_METRICS_PORT"] == "9300"
    assert (DEPLOY / "Dockerfile").exists() and (DEPLOY / "README.md").exists()


def test_every_kvgate_variable_in_deploy_is_a_setting_the_worker_or_the_gateway_reads():
    import re

    from kvgate.gateway.settings import GatewaySettings
    from kvgate.worker.settings import WorkerSettings

    known = {f"KVGATE_{name.upper()}" for name in WorkerSettings.model_fields}
    known |= {"KVGATE_EXPORTER_PORT", "KVGATE_EXPORTER_ADDR"}  # read by `kvgate exporter`
    known |= {f"KVGATE_{name.upper()}" for name in GatewaySettings.model_fields}  # `kvgate serve`
    used = set()
    for path in [*K8S.glob("*.yaml"), DEPLOY / "compose.yaml"]:
        used |= set(re.findall(r"\bKVGATE_[A-Z0-9_]+", path.read_text()))
    assert used and not used - known, f"unknown settings: {sorted(used - known)}"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_images_copy_every_package_folder_and_install_worker_and_gateway(name):
    """`pip install .` in the image builds what pyproject maps: a folder left out breaks every command."""
    import tomllib

    text = (DEPLOY / name).read_text()
    copied = set(re.findall(r"^COPY (\S+) ", text, re.M))
    mapped = set(tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert mapped <= copied, f"{name} does not copy {sorted(mapped - copied)}"
    assert '".[worker,gateway]"' in text and "ENTRYPOINT [\"kvgate\"]" in text


def test_cpu_image_pins_the_cpu_torch_and_gpu_image_asks_for_cuda():
    cpu, gpu = ((DEPLOY / n).read_text() for n in ("Dockerfile", "Dockerfile.gpu"))
    assert "download.pytorch.org/whl/cpu" in cpu and "KVGATE_DEVICE=cpu" in cpu
    assert "whl/cpu" not in gpu.split("ARG TORCH_SPEC=")[1].splitlines()[0]
    assert "KVGATE_DEVICE=cuda" in gpu
    from kvgate.engine.config import EngineConfig

    assert EngineConfig(device="cuda").device == "cuda"  # a value the worker accepts


def test_gateway_reads_its_redis_url_and_api_keys_from_secrets_that_the_example_defines():
    [gateway] = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "kvgate-gateway"]
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    example = {d["metadata"]["name"]: d["stringData"]
               for d in yaml.safe_load_all((DEPLOY / "k8s/redis-secret.example.yaml").read_text())}
    for name in ("KVGATE_REDIS_URL", "KVGATE_API_KEYS"):
        assert refs[name]["key"] in example[refs[name]["name"]], name
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"  # a route the gateway serves
    assert "httpGet" not in container["livenessProbe"]  # a Redis outage must not restart the replicas
    assert container["args"][:1] == ["serve"] and "0.0.0.0" in container["args"]


def test_gateway_replicas_share_one_read_write_many_files_dir():
    """Batch files must be seen by every replica: the one driving a batch may not be the one that took the upload."""
    pod = named("Deployment", "kvgate-gateway")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    [mount] = container["volumeMounts"]
    assert env_of(container)["KVGATE_FILES_DIR"] == mount["mountPath"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = named("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_a_worker_asking_for_cuda_runs_the_cuda_image():
    for d in of_kind("Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            if env_of(c).get("KVGATE_DEVICE") == "cuda":
                assert c["image"].endswith("-cuda"), c["image"]
