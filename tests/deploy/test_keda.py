"""KEDA: every ScaledObject deploy/ holds or render_models.py renders fits the pinned release's ScaledObject schema
(deploy/keda/, the release's CRD byte for byte) and the activation rules of that release; the Deployments it renders fit Kubernetes'
schemas; and what it renders is the policy W-SCALE simulates (kvgate/bench/scale_policy.py)."""
from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from kvgate.bench.scale_policy import Behavior, WorkScaling
from tests.deploy.keda_crd import CRD, CRD_BLOB, VERSION, blob_id, scaled_object_schema, strict
from tests.deploy.test_render_models import _render

DEPLOY = Path(__file__).parents[2] / "deploy"
SCHEMA = scaled_object_schema()
STREAM_SCALERS = ("redis-streams", "redis-cluster-streams", "redis-sentinel-streams")


def render(*argv: str) -> list[dict]:
    done = _render(*argv)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def checked_in() -> list[dict]:
    return [d for path in sorted(DEPLOY.glob("k8s/**/keda-scaledobject.yaml"))
            for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "ScaledObject"]


def rendered() -> list[dict]:
    return render("Qwen/Qwen2.5-7B-Instruct=/models/qwen", "small=/s", "--alias", "Qwen/Qwen2.5-7B-Instruct=qwen") + \
        render("m=/w", "--cluster-shards", "4", "--cluster-addresses", "r0:7000,r1:7001")


def activation_problems(so: dict) -> list[str]:
    """What KEDA 2.16 refuses or misreads in a ScaledObject's triggers, beyond its schema."""
    problems = []
    for t in so["spec"]["triggers"]:
        meta = t["metadata"]
        if t["type"] in STREAM_SCALERS and "lagCount" in meta and int(meta.get("activationLagCount", "0")) < 1:
            problems.append(f"{t['type']} {meta.get('stream')}: activationLagCount must be >= 1 with lagCount on "
                            "KEDA 2.16 (kedacore/keda#6478)")
        if t["type"] == "prometheus" and not float(meta.get("activationThreshold", "0")) >= 0:
            problems.append(f"prometheus {t.get('name')}: activationThreshold below 0")
        if t.get("metricType", "AverageValue") not in ("AverageValue", "Value"):
            problems.append(f"{t['type']}: metricType {t['metricType']} is not one an external scaler takes")
    return problems


def test_the_pinned_release_is_one_fact_the_manifests_and_docs_name():
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    assert blob_id(CRD.read_bytes()) == CRD_BLOB, f"{CRD} is not KEDA v{VERSION}'s file: take it from the release"
    assert f"v{VERSION}" in (DEPLOY / "keda/README.md").read_text() and CRD_BLOB in (DEPLOY / "keda/README.md").read_text()
    for text in ((DEPLOY / "k8s/keda-scaledobject.yaml").read_text(), (DEPLOY / "keda/README.md").read_text(),
                 (DEPLOY.parent / "docs/operations/autoscaling.md").read_text()):
        assert f"--version {VERSION}" in text and not re.search(r"--version (?!" + re.escape(VERSION) + r")\d", text)


@pytest.mark.parametrize("source", ["checked-in", "rendered"])
def test_every_scaled_object_fits_the_pinned_keda_schema_and_its_activation_rules(source):
    objects = checked_in() if source == "checked-in" else [d for d in rendered() if d["kind"] == "ScaledObject"]
    assert len(objects) >= 3
    for so in objects:
        jsonschema.validate(so, SCHEMA)
        assert not activation_problems(so)


def test_strictness_closes_listed_objects_only_and_is_what_refuses_a_misspelt_field():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                               "m": {"type": "object", "additionalProperties": {"type": "string"}},
                                               "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                                        "properties": {"c": {"type": "string"}}}}}
    closed = strict(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["m"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in closed["properties"]["free"] and "additionalProperties" not in schema
    so = copy.deepcopy(checked_in()[0])
    so["spec"]["coolDownPeriod"] = 300
    (served,) = yaml.safe_load(CRD.read_bytes())["spec"]["versions"]
    jsonschema.validate(so, served["schema"]["openAPIV3Schema"])  # the CRD as it is would let it through
    with pytest.raises(jsonschema.ValidationError, match="coolDownPeriod"):
        jsonschema.validate(so, SCHEMA)


def test_the_schema_and_the_rules_refuse_what_keda_would():
    so = checked_in()[0]
    for change, path in ((lambda s: s["spec"].update(coolDownPeriod=300), "coolDownPeriod"),
                         (lambda s: s["spec"]["triggers"][0]["metadata"].update(lagCount=16), "lagCount"),
                         (lambda s: s["spec"]["triggers"][0].pop("type"), "type"),
                         (lambda s: s["spec"].update(pollingInterval="15"), "pollingInterval")):
        bad = copy.deepcopy(so)
        change(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCHEMA)
    bad = copy.deepcopy(so)
    stream = next(t for t in bad["spec"]["triggers"] if t["type"] in STREAM_SCALERS)
    stream["metadata"]["activationLagCount"] = "0"  # what deploy/ held before KEDA 2.16 refused it
    assert "kedacore/keda#6478" in activation_problems(bad)[0]


def test_rendered_deployments_fit_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate for schema checks")
    deployments = [d for d in rendered() if d["kind"] == "Deployment"]
    assert len(deployments) == 3
    for d in deployments:
        kv.validate(d, "1.30", strict=True)


def test_what_deploy_holds_and_renders_is_the_policy_w_scale_simulates():
    """One job wakes a fleet at zero, nothing waiting lets it go, and the work triggers, thresholds and HPA behaviour
    are scale_policy's: the checked-in default object equals the rendered one and both equal the simulated policy."""
    b, scaling = Behavior(), WorkScaling()
    plain = next(so for so in checked_in() if any(t["type"] == "redis-streams" for t in so["spec"]["triggers"]))
    for so in [plain] + [d for d in rendered() if d["kind"] == "ScaledObject"]:
        spec = so["spec"]
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (b.min_replicas, b.max_replicas)
        assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (b.polling_s, b.cooldown_s)
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        for side, window, policies in (("scaleUp", b.up_window_s, b.up_policies),
                                       ("scaleDown", b.down_window_s, b.down_policies)):
            assert behavior[side]["stabilizationWindowSeconds"] == window
            assert behavior[side]["policies"] == [{"type": p.kind, "value": p.value, "periodSeconds": p.period_s}
                                                  for p in policies]
        prom = {t["name"]: t for t in spec["triggers"] if t["type"] == "prometheus"}
        assert sorted(prom) == ["work-deadline", "work-wake", "work-work"]
        assert prom["work-wake"]["metadata"]["activationThreshold"] == "0"  # above 0: one job waiting wakes it
        assert float(prom["work-deadline"]["metadata"]["threshold"]) == scaling.worker_tokens_per_s
        assert all(t["metricType"] == "AverageValue" for t in prom.values())
    names = ["default"]
    assert [t["metadata"]["query"] for t in plain["spec"]["triggers"] if t["type"] == "prometheus"] == \
        [t.query for t in scaling.triggers("kvgate", names)]


def test_render_flags_set_the_work_triggers_and_refuse_values_out_of_range():
    so = next(d for d in render("m=/w", "--worker-tokens-per-s", "5000", "--deadline-margin", "0.5")
              if d["kind"] == "ScaledObject")
    prom = {t["name"]: t["metadata"] for t in so["spec"]["triggers"] if t["type"] == "prometheus"}
    assert prom["work-deadline"]["threshold"] == "5000" and prom["work-deadline"]["query"].endswith("/ 0.5")
    done = _render("m=/w", "--utilisation", "1.5")
    assert done.returncode == 2 and "--utilisation 1.5 must be in (0, 1]" in done.stderr


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (apt-get install prometheus ships it)")
def test_every_trigger_query_parses_as_promql(tmp_path):
    """Each prometheus trigger's query, as a recording rule: promtool parses it as Prometheus would."""
    queries = {t["metadata"]["query"] for so in checked_in() + [d for d in rendered() if d["kind"] == "ScaledObject"]
               for t in so["spec"]["triggers"] if t["type"] == "prometheus"}
    rules = tmp_path / "queries.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": [
        {"record": f"kvgate:keda_query_{i}", "expr": q} for i, q in enumerate(sorted(queries))]}]}))
    done = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
