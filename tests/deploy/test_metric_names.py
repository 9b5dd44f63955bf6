"""Every metric the dashboard and alerts query is one the code really exports (after exercising it)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import yaml

from kvgate.producer.keys import Keys, lora_entry
from kvgate.producer.protocol import FIELD, PROTOCOL_VERSION, Job, encode
from kvgate.commands.exporter import build_registry
from kvgate.gateway.metrics import GatewayMetrics
from kvgate.worker.metrics import WorkerMetrics
from kvgate.worker.heartbeat import write_beat
from kvgate.worker.tenant_load import TenantLoad

DEPLOY = Path(__file__).parents[2] / "deploy"
NAME = re.compile(r"\bkvgate_[a-z0-9_]+")
BY = re.compile(r"\bby \(([^)]*)\)")


def queried_expressions() -> list[str]:
    dash = json.loads((DEPLOY / "grafana/dashboards/kvgate.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    alerts = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    keda = [t["metadata"]["query"] for path in sorted(DEPLOY.glob("k8s/**/keda-scaledobject.yaml"))
            for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "ScaledObject"
            for t in d["spec"]["triggers"] if t["type"] == "prometheus"]
    return exprs + [r["expr"] for g in alerts["groups"] for r in g["rules"]] + keda


def exported(shared_redis, namespace) -> tuple[set[str], set[str]]:
    worker = WorkerMetrics("w", "m")
    stats = SimpleNamespace(running=1, waiting=1, free_blocks=1, total_blocks=2, kv_usage=0.5, preemptions=1,
                            stepped_aside=1, prefix_hit_tokens=1, prefix_query_tokens=2, prompt_tokens=3, generation_tokens=4)
    worker.on_step(stats, 0.01, 1)
    worker.on_admitted(0.1)
    worker.on_first_token(0.1)
    worker.on_finished("done", 1.0, 0.01, 3, 4, 1)
    worker.on_redelivery()
    worker.on_dead_letter("invalid")
    worker.on_lanes(3)
    worker.on_steals(2)
    client, keys = shared_redis.client(), Keys(namespace)
    client.xadd(keys.jobs(None, "normal"), {"p": b"x"})
    seconds, _ = client.time()  # a job with a deadline: the work gauges' slack and the rate it needs
    client.xadd(keys.jobs(None, "high"), {FIELD: encode(Job(v=PROTOCOL_VERSION, job_id="j", client_id="c",
                                                            enqueued_at=seconds, prompt="x", deadline=seconds + 3600))})
    client.set(keys.fair(), 1)  # fair share on: the per-tenant backlog is exported
    client.hset(keys.loras(), "sql", lora_entry("/adapters/sql", "default"))  # an adapter: the per-adapter view
    load = TenantLoad()
    load.admitted("team-a", 0.2, now=1.0)
    load.finished("team-a", 40, now=1.0)
    write_beat(client, keys, "w", {"worker_id": "w", "free_blocks": 3, "total_blocks": 4, "models": "default",
                                   "tenants": json.dumps(load.snapshot(["team-a"], now=2.0))}, ttl_s=60)
    gateway = GatewayMetrics()
    gateway.requests.labels("/v1/chat/completions", "200").inc()
    gateway.latency.labels("/v1/chat/completions").observe(0.1)
    gateway.ttft.labels("/v1/chat/completions").observe(0.1)
    names, labels = set(), {"le"}
    for registry in (worker.registry, build_registry(client, keys), gateway.registry):
        for family in registry.collect():
            for sample in family.samples:
                names.add(sample.name)
                labels |= sample.labels.keys()
    return names, labels


def test_every_queried_metric_and_grouping_label_is_exported(shared_redis, namespace):
    names, labels = exported(shared_redis, namespace)
    exprs = queried_expressions()
    queried = {n for e in exprs for n in NAME.findall(e)} - labels  # kvgate_namespace is a label
    assert queried, "no kvgate_ metric found in the dashboard or alerts"
    assert not queried - names, f"queried but never exported: {sorted(queried - names)}"
    grouped = {label.strip() for e in exprs for group in BY.findall(e) for label in group.split(",")}
    assert not grouped - labels, f"grouped by labels nothing exports: {sorted(grouped - labels)}"
    for e in exprs:  # a label value selector may only use exported labels too
        for label in re.findall(r"([a-z_]+)=~?\"", e):
            assert label in labels, (label, e)


def test_every_design_metric_is_exported(shared_redis, namespace):
    names, _ = exported(shared_redis, namespace)
    design = ["requests_running", "requests_waiting_local", "kv_cache_usage_ratio", "kv_free_blocks",
              "prefix_cache_hit_ratio", "prompt_tokens_total", "generation_tokens_total",
              "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
              "e2e_request_latency_seconds_bucket", "queue_wait_seconds_bucket", "jobs_finished_total",
              "preemptions_total", "stepped_aside_total", "redeliveries_total", "dead_letters_total",
              "queue_lag", "queue_pending", "queue_length", "queue_oldest_job_age_seconds", "live_workers",
              "fleet_free_kv_blocks", "fleet_free_kv_tokens", "dead_stream_length",
              "affinity_lanes_owned", "affinity_steals_total", "tenant_backlog", "tenant_running_jobs",
              "tenant_tokens_per_second", "tenant_queue_wait_p50_seconds", "tenant_queue_wait_p99_seconds",
              "queue_tokens_waiting", "queue_drain_seconds", "queue_deadline_slack_seconds",  # autoscaling on work
              "queue_deadline_tokens_per_second_needed", "model_tokens_per_second", "model_kv_usage_ratio"]
    assert not {f"kvgate_{d}" for d in design} - names


def test_the_dashboard_plots_each_tenants_backlog_running_tokens_and_queue_wait_by_tenant():
    """Issue 27's per-tenant view: every figure on the board, grouped by the bounded `tenant` label."""
    exprs = queried_expressions()
    for metric in ("tenant_backlog", "tenant_running_jobs", "tenant_tokens_per_second",
                   "tenant_queue_wait_p50_seconds", "tenant_queue_wait_p99_seconds"):
        assert any(f"kvgate_{metric}" in e and "by (tenant)" in e for e in exprs), metric


def test_the_dashboard_plots_each_adapters_backlog_and_wait_by_adapter_and_each_workers_slots_by_worker():
    """Issue 42's views: the per-adapter figures grouped by the bounded `adapter` label, the slots by worker."""
    exprs = queried_expressions()
    for metric in ("adapter_backlog", "adapter_pending", "adapter_oldest_job_age_seconds", "adapter_loaded_workers"):
        assert any(f"kvgate_{metric}" in e and "by (adapter)" in e for e in exprs), metric
    for metric in ("lora_adapters_loaded", "lora_loads_total", "lora_evictions_total"):
        assert any(f"kvgate_{metric}" in e and "by (worker)" in e for e in exprs), metric


def test_every_dashboard_query_parses_as_promql(tmp_path):
    """Each panel's and variable's query, its Grafana variables filled in, as a recording rule: promtool parses it as
    Prometheus would (a typo in a panel shows as an empty graph, never as an error)."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus ships it)")
    dash = json.loads((DEPLOY / "grafana/dashboards/kvgate.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    fill = {"$__rate_interval": "5m", "$ns": ".*", "$model": ".*", "$worker": ".*"}
    rules = []
    for i, e in enumerate(exprs):
        for var, value in fill.items():
            e = e.replace(var, value)
        assert "$" not in e, f"a Grafana variable this test does not fill in: {e}"
        rules.append({"record": f"kvgate:dashboard_{i}", "expr": e})
    path = tmp_path / "dashboard.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_real_worker_feeds_the_series_the_dashboard_plots(shared_redis, namespace):
    """Through the production Worker loop, not hand-called hooks: the latency panels would be empty otherwise."""
    import time

    from kvgate.bench import fleet_sim

    keys, client = Keys(namespace), shared_redis.client()
    jobs = fleet_sim.make_jobs(3, fleet_sim.JobMix(max_tokens=(4, 4)), seed=0, clients=1)
    fleet = fleet_sim.start_fleet(shared_redis.url, namespace, fleet_sim.mixed_fleet(1), "capacity",
                                  step_overhead_s=0.001, per_token_s=0.0)
    try:
        fleet_sim.enqueue(client, keys, jobs, rate=None)
        deadline = time.monotonic() + 20
        while fleet_sim.count_results(client, keys, jobs) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the finish hook runs after the publish that made the result visible
        registry = build_registry(client, keys)  # the work autoscaling reads: the rate from the workers' heartbeats
        served = lambda: registry.get_sample_value("kvgate_model_tokens_per_second",
                                                   {"kvgate_namespace": namespace, "model": "default",
                                                    "served_by": "default"}) or 0
        while not served() and time.monotonic() < deadline + 10:  # the next beat carries the finished jobs
            time.sleep(0.1)
        assert served() > 0
    finally:
        fleet.stop()
    metrics = fleet.workers[0].metrics
    value = lambda name, **kw: metrics.registry.get_sample_value(name, {**metrics.labels, **kw})
    assert value("kvgate_jobs_admitted_total") == 3
    assert value("kvgate_jobs_finished_total", status="done") == 3
    for hist in ("queue_wait", "time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert value(f"kvgate_{hist}_seconds_count") == 3, hist
    assert value("kvgate_generation_tokens_total") == 12
    assert value("kvgate_kv_free_blocks") > 0


def test_the_lag_keda_scales_on_counts_the_jobs_waiting_in_tenants_streams(shared_redis, namespace):
    """Fair share: kvgate_queue_lag of a model's priority (the KEDA prometheus triggers' query) counts the jobs its
    tenants' streams hold, not only the shared stream's."""
    from kvgate.producer.client import Client

    client, keys = shared_redis.client(), Keys(namespace)
    client.set(keys.fair(), 1)
    client.sadd(keys.models(), "default")
    with Client(shared_redis.url, namespace, tenant="acme") as producer:
        producer.submit_many([{"prompt": "x"}] * 4, progress=False)
    lag = {tuple(sample.labels[k] for k in ("model", "priority")): sample.value
           for family in build_registry(client, keys).collect() for sample in family.samples
           if sample.name == "kvgate_queue_lag"}
    assert lag[("default", "normal")] == 4, lag
    tokens = {sample.labels["priority"]: sample.value for family in build_registry(client, keys).collect()
              for sample in family.samples if sample.name == "kvgate_queue_tokens_waiting"}
    assert tokens["normal"] > 0, tokens  # the work triggers see them too (the tenants served next sampled)
