"""Render one worker Deployment and one KEDA ScaledObject per model, from the single-model manifests in k8s/.

    python deploy/render_models.py Qwen/Qwen2.5-7B-Instruct=/models/Qwen2.5-7B-Instruct \
        HuggingFaceTB/SmolLM2-135M-Instruct=smollm2-135m --alias HuggingFaceTB/SmolLM2-135M-Instruct=smol \
        > models.yaml && kubectl apply -f models.yaml

Each model NAME=WEIGHTS gets `kvgate-worker-<slug>`: the worker Deployment of k8s/worker-deployment.yaml loading
WEIGHTS and serving NAME (KVGATE_SERVED_MODEL_NAME) and its aliases, not the `default` model; and the
ScaledObject of k8s/keda-scaledobject.yaml with one wake trigger per priority for each name it serves
(`{ns}:jobs:<name>:<priority>`) and the prometheus triggers that scale on that model's work, over all its names
and its LoRA adapters' (kvgate/bench/scale_policy.py: they select the exporter's `served_by`, whose rows count the
streams of adapters registered at run time in their base's; --worker-tokens-per-s, --deadline-margin, --utilisation
and --drain-s set them),
so a job for a model or one of its adapters with no worker wakes that model's Deployment from zero and its work
sizes it.
The base manifests stay the one place to change probes, resources or scaling behaviour. Apply the output
instead of worker-deployment.yaml and the ScaledObject in keda-scaledobject.yaml (keep its
TriggerAuthentication); the default model's pair is what those two files are.

On a Redis Cluster, `--cluster-shards N` (the namespace's shard count: `?shards=` in the workers' URL, recorded at
`{ns}:shards`) renders `redis-cluster-streams` triggers instead, one per shard and priority of each name, on the
stream names kvgate's Keys give (their hash tags put each shard in its slot); `--cluster-addresses` are the nodes
KEDA starts from. Keep k8s/cluster/keda-scaledobject.yaml's TriggerAuthentication; its ScaledObject is the default
model's, rendered by `default_cluster_scaled_object`.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvgate.bench.scale_policy import Trigger, WorkScaling  # the policy W-SCALE simulates
from kvgate.producer.keys import Keys  # stream names as kvgate writes them (needs the SDK: pip install kvgate)
from kvgate.producer.shards import MAX_SHARDS

K8S = Path(__file__).parent / "k8s"
PRIORITIES = ("high", "normal", "low")
FORBIDDEN = re.compile(r"[\s{},]")
CLUSTER_ADDRESSES = ",".join(f"kvgate-redis-cluster-{i}.kvgate-redis-cluster-headless:6379" for i in range(6))
CLUSTER_AUTH = "kvgate-redis-cluster-keda"


@dataclass(slots=True)
class Model:
    name: str  # what jobs ask for (KVGATE_SERVED_MODEL_NAME)
    weights: str  # what the worker loads (KVGATE_MODEL)
    aliases: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    @property
    def slug(self) -> str:
        """A DNS-1123 label part; the hash keeps `Qwen/Qwen2.5` and `qwen-qwen2.5` apart."""
        base = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")[:40].strip("-")
        return f"{base}-{hashlib.sha256(self.name.encode()).hexdigest()[:6]}"


def check_name(name: str) -> str:
    if not name or len(name) > 128 or FORBIDDEN.search(name):
        raise ValueError(f"model name {name!r} must have 1 to 128 characters and no whitespace, braces or commas")
    return name


def check_cluster(shards: int, addresses: str) -> int:
    if shards < 0 or shards > MAX_SHARDS:
        raise ValueError(f"--cluster-shards {shards} must be from 1 to {MAX_SHARDS} (0: a single Redis, no shards); "
                         "give the namespace's count, `?shards=` in the workers' redis+cluster:// URL")
    bad = [a for a in addresses.split(",") if not re.fullmatch(r"[^\s:,]+:\d+", a)]
    if shards and bad:
        raise ValueError(f"--cluster-addresses: {bad[0]!r} is not host:port; give host1:6379,host2:6379")
    return shards


def check_scaling(scaling: WorkScaling) -> WorkScaling:
    for name in ("deadline_margin", "utilisation"):
        if not 0 < getattr(scaling, name) <= 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(scaling, name):g} must be in (0, 1]: a share")
    for name in ("worker_tokens_per_s", "drain_s"):
        if not getattr(scaling, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(scaling, name):g} must be positive")
    return scaling


def parse_models(specs: list[str], aliases: list[str]) -> list[Model]:
    models: dict[str, Model] = {}
    for spec in specs:
        name, sep, weights = spec.rpartition("=")
        if not sep or not name or not weights:
            raise ValueError(f"{spec!r}: give NAME=WEIGHTS, e.g. Qwen/Qwen2.5-7B-Instruct=/models/Qwen2.5-7B-Instruct")
        models[check_name(name)] = Model(name, weights)
    for spec in aliases:
        name, sep, alias = spec.rpartition("=")
        if name not in models:
            raise ValueError(f"--alias {spec!r}: give MODEL=ALIAS for one of the models {sorted(models)}")
        models[name].aliases.append(check_name(alias))
    return list(models.values())


def _base(path: str, kind: str) -> dict:
    return next(d for d in yaml.safe_load_all((K8S / path).read_text()) if d and d["kind"] == kind)


def deployment(model: Model, namespace: str) -> dict:
    d = copy.deepcopy(_base("worker-deployment.yaml", "Deployment"))
    name = f"kvgate-worker-{model.slug}"
    labels = {**d["metadata"]["labels"], "kvgate.dev/model": model.slug}
    d["metadata"] = {"name": name, "labels": labels, "annotations": {"kvgate.dev/model-name": model.name}}
    d["spec"]["selector"]["matchLabels"] = labels
    d["spec"]["template"]["metadata"]["labels"] = labels
    container = d["spec"]["template"]["spec"]["containers"][0]
    overrides = {"KVGATE_NAMESPACE": namespace, "KVGATE_MODEL": model.weights, "KVGATE_SERVED_MODEL_NAME": model.name,
                 "KVGATE_MODEL_ALIASES": ",".join(model.aliases), "KVGATE_SERVE_DEFAULT": "false"}
    env = [e for e in container["env"] if e["name"] not in overrides]
    container["env"] = env + [{"name": k, "value": v} for k, v in overrides.items() if v]
    return d


def scaled_object(model: Model, namespace: str, shards: int = 0, addresses: str = CLUSTER_ADDRESSES,
                  scaling: WorkScaling = WorkScaling()) -> dict:
    so = copy.deepcopy(_base("keda-scaledobject.yaml", "ScaledObject"))
    name = f"kvgate-worker-{model.slug}"
    so["metadata"] = {"name": name, "annotations": {"kvgate.dev/model-name": model.name}}
    so["spec"]["scaleTargetRef"] = {"name": name}
    so["spec"]["triggers"] = triggers(so, model.names, namespace, shards, addresses, scaling)
    return so


def triggers(so: dict, names: list[str], namespace: str, shards: int, addresses: str,
             scaling: WorkScaling = WorkScaling()) -> list[dict]:
    """One wake trigger per priority of each name on its streams (on a cluster, `shards` > 0: per shard and
    priority), read from Redis directly; then the prometheus triggers that scale on work (kvgate/bench/scale_policy.py,
    docs/operations/autoscaling.md) over every name and adapter it serves, lanes, shards and tenants' streams summed
    by the exporter (an adapter's streams have no redis-streams trigger: it is registered at run time)."""
    base = so["spec"]["triggers"]
    by_priority = {t["metadata"]["stream"].rsplit(":", 1)[-1]: t for t in base if t["type"] == "redis-streams"}
    server = next(t["metadata"]["serverAddress"] for t in base if t["type"] == "prometheus")
    keys = Keys(namespace, shards, cluster=True) if shards else Keys(namespace)
    out = []
    for served in names:
        for priority in PRIORITIES:
            for shard in range(len(keys.parts)):
                trigger = copy.deepcopy(by_priority[priority])
                trigger["metadata"]["stream"] = keys.jobs(served, priority, shard=shard)
                out.append(cluster_trigger(trigger, shards, addresses) if shards else trigger)
    return out + [prometheus_trigger(t, server) for t in scaling.triggers(namespace, names)]


def prometheus_trigger(trigger: Trigger, server: str) -> dict:
    """AverageValue: the HPA asks for ceil(value / threshold) workers; active (awake from zero) while the value is
    above activationThreshold."""
    return {"type": "prometheus", "name": f"work-{trigger.name}", "metricType": "AverageValue",
            "metadata": {"serverAddress": server, "query": trigger.query, "threshold": f"{trigger.target:g}",
                         "activationThreshold": f"{trigger.activation:g}"}}


def cluster_trigger(trigger: dict, shards: int, addresses: str) -> dict:
    """The same trigger read through KEDA's cluster client. HPA scales to the largest trigger, not their sum, and
    a backlog spread evenly over the shards shows each trigger 1/shards of it: so each shard's lagCount is the
    single stream's divided by the shard count, to add a pod at about the same total backlog."""
    meta = trigger["metadata"]
    lag = max(1, round(int(meta["lagCount"]) / shards))
    return {"type": "redis-cluster-streams",
            "metadata": {"addresses": addresses, "stream": meta["stream"], "consumerGroup": meta["consumerGroup"],
                         "lagCount": str(lag), "activationLagCount": meta["activationLagCount"]},
            "authenticationRef": {"name": CLUSTER_AUTH}}


def default_cluster_scaled_object(namespace: str, shards: int, addresses: str = CLUSTER_ADDRESSES) -> dict:
    """k8s/keda-scaledobject.yaml's ScaledObject (the `default` model's) on a cluster: k8s/cluster/ holds it."""
    so = copy.deepcopy(_base("keda-scaledobject.yaml", "ScaledObject"))
    so["spec"]["triggers"] = triggers(so, ["default"], namespace, shards, addresses)
    return so


def render(models: list[Model], namespace: str = "kvgate", shards: int = 0, addresses: str = CLUSTER_ADDRESSES,
           scaling: WorkScaling = WorkScaling()) -> str:
    docs = [doc for m in models
            for doc in (deployment(m, namespace), scaled_object(m, namespace, shards, addresses, scaling))]
    return yaml.safe_dump_all(docs, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", metavar="NAME=WEIGHTS", help="a served model name and what to load")
    parser.add_argument("--alias", action="append", default=[], metavar="NAME=ALIAS", help="another name for NAME")
    parser.add_argument("--namespace", default="kvgate", help="the kvgate key namespace (KVGATE_NAMESPACE)")
    parser.add_argument("--cluster-shards", type=int, default=0, metavar="N",
                        help="a Redis Cluster namespace split into N shards (the workers' URL ?shards=N): "
                             "redis-cluster-streams triggers, one per shard and priority")
    parser.add_argument("--cluster-addresses", default=CLUSTER_ADDRESSES, metavar="HOST:PORT,...",
                        help="cluster nodes KEDA connects to (default: a 6-node kvgate-redis-cluster StatefulSet)")
    for f in dataclasses.fields(WorkScaling):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=f.default, metavar="X",
                            help=f"scaling on work: {f.name} (default {f.default:g}; docs/operations/autoscaling.md)")
    args = parser.parse_args(argv)
    try:
        shards = check_cluster(args.cluster_shards, args.cluster_addresses)
        scaling = check_scaling(WorkScaling(**{f.name: getattr(args, f.name) for f in dataclasses.fields(WorkScaling)}))
        sys.stdout.write(render(parse_models(args.models, args.alias), args.namespace, shards, args.cluster_addresses,
                                scaling))
    except ValueError as e:
        print(f"render_models: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
