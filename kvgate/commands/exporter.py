"""`kvgate exporter`: queue and fleet gauges read from Redis at scrape time.

One process per kvgate namespace is enough; it holds no state, so any number of replicas agree. The label is
`kvgate_namespace` because Prometheus already puts the Kubernetes `namespace` on every target; queue gauges
carry `model` (a model workers serve: a name a worker served or an operator added, `default` for jobs that name
none), `served_by` (the same name: the KEDA triggers select on it) and `priority`. A LoRA adapter's jobs wait on
streams of its own but count in its base model's rows, at its base fleet's rate (queue_stats.ServedStats): adapters
are registered at run time, hundreds of them, and a row each would break the rule of every per-name view. Per-name
views carry `tenant` or `adapter` (what one adapter alone waits for), bounded to the ten busiest names and `_other`
(limits.top_and_rest). The figures come from producer.queue_stats, which also counts lag on Redis 6.2 (no `lag` in
XINFO GROUPS).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import redis
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily

from kvgate.producer.connection import DEFAULT_URL, mask_url, resolve_url
from kvgate.producer.keys import Keys
from kvgate.producer.limits import OTHER_TENANTS
from kvgate.producer.queue_stats import QueueStats, ServedStats, read_queue_stats
from kvgate.producer.queue_work import ModelWork, read_queue_work
from kvgate.producer.redis_url import connect, keys_for

BY_MODEL = ["kvgate_namespace", "model", "served_by"]  # every per-model gauge's labels (then `priority`, if any)


def _model_labels(ns: str, m: ServedStats | ModelWork) -> list[str]:
    """`served_by` repeats `model`. The KEDA triggers select on it (rendered while an adapter had rows of its own,
    `served_by` its base); it stays so those ScaledObjects keep reading."""
    return [ns, m.model, m.model]


class FleetCollector:
    """A Prometheus collector that asks Redis at each scrape, so the figures are never stale."""

    def __init__(self, client: redis.Redis, keys: Keys):
        self.client, self.keys = client, keys

    def collect(self):
        ns = self.keys.ns
        up = GaugeMetricFamily("kvgate_exporter_redis_up", "1 if the last scrape could read Redis",
                               labels=["kvgate_namespace"])
        started = time.perf_counter()
        try:
            snap = read_queue_stats(self.client, self.keys)
            work = read_queue_work(self.client, self.keys, snap)
        except redis.RedisError:
            up.add_metric([ns], 0)
            yield up
            return
        up.add_metric([ns], 1)
        yield up
        served = list(snap.served.values())  # one row per model workers serve, its adapters' streams summed in
        yield from _stream_families(ns, served)
        yield from _model_families(ns, served)
        yield from _fleet_families(ns, snap)
        yield from _tenant_families(ns, snap)
        yield from _tenant_view_families(ns, snap)
        yield from _adapter_families(ns, snap)
        yield from _work_families(ns, list(work.values()))
        took = GaugeMetricFamily("kvgate_exporter_scrape_seconds", "Time to read the fleet from Redis",
                                 labels=["kvgate_namespace"])
        took.add_metric([ns], time.perf_counter() - started)
        yield took


def _stream_families(ns: str, models: list[ServedStats]):
    specs = (("queue_lag", "Jobs waiting: not yet delivered to any worker, or parked for deadline order", "backlog"),
             ("queue_pending", "Jobs delivered to a worker and not yet acknowledged", "pending"),
             ("queue_length", "Entries in the job stream (XLEN)", "length"),
             ("queue_oldest_job_age_seconds", "Age of the oldest job not yet acknowledged", "oldest_age_s"))
    for name, doc, attr in specs:
        family = GaugeMetricFamily(f"kvgate_{name}", doc, labels=[*BY_MODEL, "priority"])
        for m in models:
            for s in m.priorities.values():
                family.add_metric([*_model_labels(ns, m), s.priority], getattr(s, attr) or 0)  # no age: nothing waits
        yield family


def _model_families(ns: str, models: list[ServedStats]):
    """Per model: who serves it, and whether its jobs (or an adapter's) wait for a scale-up (no live worker)."""
    workers = GaugeMetricFamily("kvgate_model_live_workers", "Live workers serving the model name (aliases count)",
                                labels=BY_MODEL)
    stranded = GaugeMetricFamily("kvgate_model_waiting_for_workers",
                                 "1 if the model has jobs waiting and no live worker serves it", labels=BY_MODEL)
    for m in models:
        workers.add_metric(_model_labels(ns, m), len(m.workers))
        stranded.add_metric(_model_labels(ns, m), int(m.waiting_for_workers))
    yield workers
    yield stranded


def _fleet_families(ns: str, snap: QueueStats):
    draining = sum(w.state == "draining" for w in snap.workers)
    specs = (("live_workers", "Workers with an unexpired heartbeat", len(snap.workers)),
             ("draining_workers", "Live workers that are draining", draining),
             ("fleet_free_kv_blocks", "Free KV blocks summed over live workers",
              sum(w.free_blocks for w in snap.workers)),
             ("fleet_free_kv_tokens", "Free KV capacity in tokens summed over live workers", snap.free_kv_tokens),
             ("fleet_total_kv_blocks", "KV blocks summed over live workers",
              sum(w.total_blocks for w in snap.workers)),
             ("fleet_admissible_tokens", "Prompt tokens the fleet could admit now",
              sum(w.admissible_tokens for w in snap.workers)),
             ("fleet_running_jobs", "Jobs running on live workers", sum(w.running for w in snap.workers)),
             ("dead_stream_length", "Entries in the dead-letter stream", snap.dead))
    for name, doc, value in specs:
        family = GaugeMetricFamily(f"kvgate_{name}", doc, labels=["kvgate_namespace"])
        family.add_metric([ns], value)
        yield family


def _tenant_families(ns: str, snap: QueueStats):
    """Tenants under quotas: the ten busiest by name and the rest as `_other` (no tenant name starts with `_`), so
    the labels stay few however many tenants there are."""
    jobs = GaugeMetricFamily("kvgate_tenant_jobs_in_flight", "A tenant's jobs queued or running, under quotas",
                             labels=["kvgate_namespace", "tenant"])
    tokens = GaugeMetricFamily("kvgate_tenant_tokens_per_minute", "A tenant's prompt plus generated tokens over the "
                               "last minute, under quotas (estimates until jobs finish)",
                               labels=["kvgate_namespace", "tenant"])
    for u in snap.tenants.top + [snap.tenants.other]:
        name = u.tenant if u is not snap.tenants.other else OTHER_TENANTS
        jobs.add_metric([ns, name], u.jobs)
        tokens.add_metric([ns, name], u.tokens_per_minute)
    yield jobs
    yield tokens


def _tenant_view_families(ns: str, snap: QueueStats):
    """Per tenant, the busiest ten by name and the rest as `_other` (limits.TOP_TENANTS, OTHER_TENANTS): backlog
    (fair share only: no series without it), running jobs, tokens served per second and queue wait p50/p99 over
    the workers' last minute (none while a tenant had no job admitted)."""
    v, labels = snap.tenant_view, ["kvgate_namespace", "tenant"]
    backlog = GaugeMetricFamily("kvgate_tenant_backlog", "A tenant's jobs waiting in its fair-share streams, not yet "
                                "delivered to a worker", labels=labels)
    running = GaugeMetricFamily("kvgate_tenant_running_jobs", "A tenant's jobs running on live workers", labels=labels)
    tokens = GaugeMetricFamily("kvgate_tenant_tokens_per_second", "A tenant's prompt plus generated tokens of jobs "
                               "finished over the workers' last minute, per second", labels=labels)
    waits = {q: GaugeMetricFamily(f"kvgate_tenant_queue_wait_p{q}_seconds", f"p{q} of a tenant's queue wait "
                                  "(enqueue to admission, server clock) over the workers' last minute", labels=labels)
             for q in (50, 99)}
    for t in v.top + [v.other]:
        if v.backlog_by_tenant:
            backlog.add_metric([ns, t.tenant], t.backlog)
        running.add_metric([ns, t.tenant], t.running)
        tokens.add_metric([ns, t.tenant], t.tokens_per_s)
        for q, family in waits.items():
            if (wait := t.wait_quantile(q / 100)) is not None:
                family.add_metric([ns, t.tenant], wait)
    yield from (backlog, running, tokens, *waits.values())


def _adapter_families(ns: str, snap: QueueStats):
    """Per registered LoRA adapter, the ten with the most backlog by name and the rest as `_other`
    (limits.top_and_rest): backlog, pending and oldest job age over its streams (every priority), and the live workers
    whose slots hold it. Each worker's own adapters, loads and evictions are its /metrics' kvgate_lora_*."""
    v, labels = snap.adapters, ["kvgate_namespace", "adapter"]
    specs = (("adapter_backlog", "Jobs waiting on a LoRA adapter's streams (every priority), not yet delivered to a "
                                 "worker", "backlog"),
             ("adapter_pending", "A LoRA adapter's jobs delivered to a worker, not yet acknowledged", "pending"),
             ("adapter_oldest_job_age_seconds", "Age of a LoRA adapter's oldest job not yet acknowledged (0: none)",
              "oldest_age_s"),
             ("adapter_loaded_workers", "Live workers whose adapter slots hold the LoRA adapter (`_other`: slots "
                                        "holding the others)", "loaded_on"))
    rows = v.top + ([v.other] if v.registered else [])  # no adapter registered: no series
    for name, doc, attr in specs:
        family = GaugeMetricFamily(f"kvgate_{name}", doc, labels=labels)
        for a in rows:
            family.add_metric([ns, a.adapter], getattr(a, attr) or 0)
        yield family


def _work_families(ns: str, models: list[ModelWork]):
    """Work, not job counts (producer/queue_work.py; docs/operations/autoscaling.md): per model and priority the tokens
    waiting, the time to drain them (and every higher priority's) at the fleet's rate, the least deadline slack and
    the rate every deadline needs; per model the fleet's rate and KV use. A drain or slack needs a measured rate:
    no series while the fleet served nothing over the last minute (KEDA reads a missing series as 0). A model's
    LoRA adapters' work is in its rows: its workers serve it at the rate they report."""
    labels, by_model = [*BY_MODEL, "priority"], BY_MODEL
    tokens = GaugeMetricFamily("kvgate_queue_tokens_waiting", "Estimated prompt plus max_tokens of the jobs not yet "
                               "delivered (sampled at both ends of each stream)", labels=labels)
    drain = GaugeMetricFamily("kvgate_queue_drain_seconds", "Seconds to drain this priority's and every higher "
                              "priority's tokens waiting at the fleet's rate over the last minute", labels=labels)
    slack = GaugeMetricFamily("kvgate_queue_deadline_slack_seconds", "Least over sampled waiting jobs of deadline "
                              "minus now minus the drain of the work ahead of them and their own (server clock)",
                              labels=labels)
    needed = GaugeMetricFamily("kvgate_queue_deadline_tokens_per_second_needed", "Least fleet rate in tokens/s at "
                               "which every sampled waiting job ends by its deadline (0: no deadline waits)",
                               labels=labels)
    rate = GaugeMetricFamily("kvgate_model_tokens_per_second", "Prompt plus generated tokens/s of jobs the live "
                             "workers serving the model finished over their last minute", labels=by_model)
    kv = GaugeMetricFamily("kvgate_model_kv_usage_ratio", "Used share of the KV blocks of the live workers "
                           "serving the model", labels=by_model)
    for m in models:
        rate.add_metric(_model_labels(ns, m), m.tokens_per_s)
        if m.kv_usage is not None:
            kv.add_metric(_model_labels(ns, m), m.kv_usage)
        for p in m.priorities.values():
            at = [*_model_labels(ns, m), p.priority]
            tokens.add_metric(at, p.tokens)
            needed.add_metric(at, p.rate_needed())
            if (seconds := p.drain_s(m.tokens_per_s)) is not None:
                drain.add_metric(at, seconds)
            if (least := p.least_slack_s(m.tokens_per_s)) is not None:
                slack.add_metric(at, least)
    yield from (tokens, drain, slack, needed, rate, kv)


def build_registry(client: redis.Redis, keys: Keys) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(FleetCollector(client, keys))
    return registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=int(os.environ.get("KVGATE_EXPORTER_PORT", "9400")),
                        help="HTTP port for /metrics (env KVGATE_EXPORTER_PORT, default 9400)")
    parser.add_argument("--addr", default=os.environ.get("KVGATE_EXPORTER_ADDR", "0.0.0.0"),
                        help="address to bind (default 0.0.0.0)")


def run(args: argparse.Namespace) -> int:
    url = resolve_url(args.redis_url, DEFAULT_URL)
    client = connect(url, socket_timeout=5, socket_connect_timeout=5)
    keys = Keys(args.namespace)
    try:  # a user without permission or a missing database will not heal: refuse to start on those
        keys = keys_for(url, client, args.namespace)  # a cluster's shards: reachable, since connect found it
        read_queue_stats(client, keys)
    except (redis.ConnectionError, redis.TimeoutError) as e:  # Redis may come up later: serve redis_up 0 till then
        print(f"kvgate exporter: Redis at {mask_url(url)} is not reachable yet ({e}); "
              "serving kvgate_exporter_redis_up 0 until it is", file=sys.stderr, flush=True)
    server, _ = start_http_server(args.port, addr=args.addr, registry=build_registry(client, keys))
    print(f"kvgate exporter: http://{args.addr}:{server.server_port}/metrics for namespace {args.namespace}",
          flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0
