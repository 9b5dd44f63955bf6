"""deploy/render_models.py: one worker Deployment and one KEDA ScaledObject per model, from the base manifests."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvgate.producer.keys import Keys
from kvgate.worker.settings import WorkerSettings

SCRIPT = Path(__file__).parents[2] / "deploy" / "render_models.py"


def _module():
    spec = importlib.util.spec_from_file_location("render_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


def _render(*argv: str) -> subprocess.CompletedProcess:
    """The script as an operator runs it, importing this tree's kvgate (not whichever one is installed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPT.parents[1]),
                                                                     os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60, env=env)


def test_two_models_get_their_own_deployment_and_scaled_object_on_their_own_streams():
    done = _render("Qwen/Qwen2.5-7B-Instruct=/models/Qwen2.5-7B-Instruct", "smol=smollm2-135m",
                   "--alias", "smol=HuggingFaceTB/SmolLM2-135M-Instruct", "--namespace", "prod")
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(done.stdout))
    deployments = {d["metadata"]["annotations"]["kvgate.dev/model-name"]: d for d in docs if d["kind"] == "Deployment"}
    scaled = {d["metadata"]["annotations"]["kvgate.dev/model-name"]: d for d in docs if d["kind"] == "ScaledObject"}
    assert sorted(deployments) == sorted(scaled) == ["Qwen/Qwen2.5-7B-Instruct", "smol"]
    names = {d["metadata"]["name"] for d in deployments.values()}
    assert len(names) == 2 and all(n.startswith("kvgate-worker-") and len(n) <= 63 for n in names)
    keys = Keys("prod")
    for model, aliases, weights in (("Qwen/Qwen2.5-7B-Instruct", [], "/models/Qwen2.5-7B-Instruct"),
                                    ("smol", ["HuggingFaceTB/SmolLM2-135M-Instruct"], "smollm2-135m")):
        dep, so = deployments[model], scaled[model]
        spec = dep["spec"]
        assert spec["selector"]["matchLabels"] == spec["template"]["metadata"]["labels"]
        container = spec["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["KVGATE_MODEL"] == weights and env["KVGATE_SERVED_MODEL_NAME"] == model
        assert env["KVGATE_SERVE_DEFAULT"] == "false" and env["KVGATE_NAMESPACE"] == "prod"
        assert env.get("KVGATE_MODEL_ALIASES", "") == ",".join(aliases)
        assert "readinessProbe" in container and container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"] and so["spec"]["minReplicaCount"] == 0
        lags = [t for t in so["spec"]["triggers"] if t["type"] == "redis-streams"]
        streams = [t["metadata"]["stream"] for t in lags]
        assert streams == [s for name in [model, *aliases] for s in keys.all_jobs(name)]
        assert all(t["metadata"]["consumerGroup"] == Keys.GROUP and t["metadata"]["activationLagCount"] == "1"
                   for t in lags)  # KEDA 2.16 refuses "0" (kedacore/keda#6478): the wake trigger takes the first job
        # every name's work and its LoRA adapters' (`served_by`: their base), lanes and tenants' streams included,
        # through the exporter: one trigger per kind
        queries = {t["name"]: t["metadata"]["query"] for t in so["spec"]["triggers"] if t["type"] == "prometheus"}
        selector = 'kvgate_namespace="prod",served_by=~"' + "|".join(n.replace(".", "\\\\.") for n in [model, *aliases])
        assert sorted(queries) == ["work-deadline", "work-wake", "work-work"]
        assert all(selector in q for q in queries.values()), (selector, queries)
        # what the Deployment sets is what the worker reads as settings
        settings = WorkerSettings(served_model_name=env["KVGATE_SERVED_MODEL_NAME"],
                                  model_aliases=env.get("KVGATE_MODEL_ALIASES", ""), serve_default=False)
        assert settings.model_aliases == aliases


def test_names_that_differ_only_in_case_or_punctuation_get_distinct_objects():
    m = _module()
    a, b = m.Model("Qwen/Qwen2.5", "/a"), m.Model("qwen-qwen2.5", "/b")
    assert a.slug != b.slug and a.slug.startswith("qwen-qwen2-5-")


@pytest.mark.parametrize("argv, message", [(["no-equals"], "NAME=WEIGHTS"), (["a b=/x"], "whitespace"),
                                           (["m=/x", "--alias", "other=y"], "MODEL=ALIAS")])
def test_bad_input_is_one_line_and_exit_2(argv, message):
    done = _render(*argv)
    assert done.returncode == 2 and message in done.stderr and done.stdout == ""
