"""Issue 42 meets issue 44: a LoRA adapter's jobs wait on its own streams, served by the workers of its base, and the
exporter counts them in its base's rows (`model` and `served_by` the base's name; one adapter alone: its
`kvgate_adapter_*` row). No redis-streams trigger names an adapter's streams (it is registered at run time), so the
prometheus triggers wake a base's fleet for them. Those render_models.py writes for the base's ScaledObject,
evaluated by promtool on the series a real exporter scrape publishes, wake the base's fleet from zero for them and
size it on their work and deadlines; another base's adapter counts for its own base only."""
from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvgate.commands import exporter
from kvgate.producer.client import Client
from kvgate.producer.keys import Keys
from tests.deploy.test_keda import DEPLOY, render

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="promtool not installed (apt-get install prometheus ships it)")

BASE = "Qwen/Qwen2.5-7B"  # its `.` is a regex metacharacter in the rendered selector
JOB = {"prompt_token_ids": [1] * 100, "max_tokens": 20}  # priced at 100 + 20 tokens (quotas.estimate_tokens)


def scraped(keys: Keys, client) -> list:
    """The exporter's /metrics over HTTP, as Prometheus reads it: every sample."""
    http, _ = exporter.start_http_server(0, addr="127.0.0.1", registry=exporter.build_registry(client, keys))
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{http.server_port}/metrics", timeout=5).read().decode()
    finally:
        http.shutdown()
    return [s for fam in text_string_to_metric_families(body) for s in fam.samples]


def promtool(samples: list, tests: dict, tmp_path, rule_files: tuple[str, ...] = ()) -> str:
    """promtool's rule unit tests over `samples` held constant for 30 minutes; its report, empty when they pass."""
    series = [{"series": s.name + "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(s.labels.items())) + "}",
               "values": " ".join([repr(float(s.value))] * 30)} for s in samples]
    files = []
    for path in rule_files or (None,):
        files.append(tmp_path / (path.name if path else "none.yml"))
        files[-1].write_text(path.read_text() if path else yaml.safe_dump({"groups": []}))
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": [f.name for f in files], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, **tests}]}))
    done = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    return "" if done.returncode == 0 else done.stdout + done.stderr


def adapters_waiting(url: str, namespace: str, client) -> list:
    """No worker runs. Adapter `sql` of BASE holds 2 normal jobs of 120 tokens and 1 low of 120 due in 30 s (under
    the 60 s floor: priced as due in 60 s); adapter `chat` of another base holds 5 high jobs. The scrape."""
    with Client(url, namespace) as producer:
        producer.add_lora("sql", "/adapters/sql", BASE)
        producer.add_lora("chat", "/adapters/chat", "other")
        for _ in range(2):
            producer.submit(lora="sql", **JOB)
        producer.submit(lora="sql", priority="low", ttl_s=30, **JOB)
        for _ in range(5):
            producer.submit(lora="chat", priority="high", **JOB)
    return scraped(Keys(namespace), client)


def test_an_adapters_jobs_wake_its_base_from_zero_and_its_work_and_deadlines_size_it(redis_server, namespace,
                                                                                     tmp_path):
    """BASE's triggers over `adapters_waiting`: wake 1; work 240 interactive tokens / 60 s = 4 (no rate served, a
    deadline waits); deadline 360 tokens (the normal ones drain first) / 60 s = 6 tokens/s, over the 0.75 margin = 8;
    `chat`'s jobs count for its own base only. Adapter-only backlog, no worker anywhere: the wake from zero is the
    prometheus trigger's alone. Before `served_by` they read nothing: the fleet stayed at zero."""
    samples = adapters_waiting(redis_server.url, namespace, redis_server.client())
    lag = {(s.labels["model"], s.labels["served_by"]): s.value for s in samples
           if s.name == "kvgate_queue_lag" and s.labels["priority"] == "normal"}
    assert lag == {(BASE, BASE): 2, ("other", "other"): 0, ("default", "default"): 0}  # the adapters' in their base's
    so = next(d for d in render(f"{BASE}=/models/qwen", "other=/models/other", "--namespace", namespace)
              if d["kind"] == "ScaledObject" and d["metadata"]["annotations"]["kvgate.dev/model-name"] == BASE)
    queries = {t["name"].removeprefix("work-"): t["metadata"]["query"] for t in so["spec"]["triggers"]
               if t["type"] == "prometheus"}
    assert sorted(queries) == ["deadline", "wake", "work"]
    expected = {"wake": 1.0, "work": 240 / 60, "deadline": 360 / 60 / 0.75}
    assert not promtool(samples, {"promql_expr_test": [
        {"expr": queries[name], "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": value}]}
        for name, value in expected.items()]}, tmp_path)


def test_the_alerts_still_fire_on_the_exporters_series_with_served_by(redis_server, namespace, tmp_path):
    """deploy/prometheus/alerts.yml over the same scrape: `kvgate_queue_lag + kvgate_queue_pending` still matches one
    to one (both carry `served_by`), so the fleet at zero with jobs waiting alerts, and each adapter's base is a
    model waiting for workers (its Deployment is the one to look at)."""
    samples = adapters_waiting(redis_server.url, namespace, redis_server.client())
    alerts = DEPLOY / "prometheus/alerts.yml"
    waiting = "kvgate model {} has jobs waiting and no live worker serving it"
    described = yaml.safe_load(alerts.read_text())["groups"][0]["rules"]
    description = next(r for r in described if r["alert"] == "KvGateModelWaitingForWorkers")["annotations"][
        "description"]
    assert not promtool(samples, {"alert_rule_test": [
        {"eval_time": "20m", "alertname": "KvGateNoLiveWorkers", "exp_alerts": [
            {"exp_labels": {"severity": "critical", "kvgate_namespace": namespace},
             "exp_annotations": {"summary": "kvgate has jobs waiting and no live worker"}}]},
        {"eval_time": "20m", "alertname": "KvGateModelWaitingForWorkers", "exp_alerts": [
            {"exp_labels": {"severity": "warning", "kvgate_namespace": namespace, "model": model},
             "exp_annotations": {"summary": waiting.format(model), "description": description}}
            for model in (BASE, "other")]}]}, tmp_path, (alerts,))
