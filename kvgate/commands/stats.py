"""`kvgate stats`: backlog, pending and oldest age per model and priority, who serves each model, the live workers
(with their LoRA adapter slots), tenants and LoRA adapters. The per-model rows are the exporter's
(QueueStats.served): a LoRA adapter's jobs count in its base model's row, and one adapter alone is in the adapters'
table (top 10 and the rest summed), so the output stays bounded however many adapters are registered."""
from __future__ import annotations

import argparse
import json

from kvgate.commands.namespace import namespace_redis
from kvgate.producer.queue_stats import QueueStats, ServedStats, read_queue_stats
from kvgate.gateway.webhooks.outbox import WebhookCounts, WebhookKeys, read_counts

NO_WORKER = "no live worker: waiting for scale-up"
NO_SLOTS = "an adapter's jobs wait: no live worker has adapter slots"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run(args: argparse.Namespace) -> int:
    with namespace_redis(args.redis_url, args.namespace) as (r, keys):
        stats = read_queue_stats(r, keys)  # a cluster's: summed over its shards
        hooks = read_counts(r, WebhookKeys(keys.prefix))  # the gateways' webhook outbox, in shard 0
    if args.json:
        print(json.dumps(stats.to_dict() | {"webhooks": hooks.to_dict()}))
    else:
        print(render(stats, args.namespace) + _webhook_lines(hooks))
    return 0


def _webhook_lines(c: WebhookCounts) -> str:
    """The gateways' webhook events (docs/webhooks.md), once there were any: failed ones went past --webhook-retry."""
    if not (c.delivered or c.failed or c.dropped or c.pending):
        return ""
    return (f"\n\nwebhooks: delivered {c.delivered}   pending {c.pending}   failed {c.failed}   "
            f"dropped (no receiver) {c.dropped}")


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def render(stats: QueueStats, namespace: str) -> str:
    lines = [f"namespace {namespace}", "",
             f"{'model':<32}{'priority':<10}{'backlog':>10}{'pending':>10}{'length':>10}{'oldest':>10}"]
    for m in stats.served.values():  # adapters' jobs in their base's row; one adapter alone: the table below
        if m.backlog or m.pending or m.workers or any(p.length for p in m.priorities.values()):
            lines += _model_lines(m)
    lines.append(f"{'total':<42}{stats.backlog:>10}{stats.pending:>10}{'':>10}{_age(stats.oldest_age_s):>10}")
    lines += ["", f"live workers: {len(stats.workers)}   free KV tokens: {stats.free_kv_tokens}   "
                  f"dead letters: {stats.dead}"]
    if stats.workers:
        lines.append(f"{'worker':<24}{'state':<10}{'running':>8}{'waiting':>8}{'KV used':>9}{'free tok':>10}"
                     f"{'tok/s':>9}{'beat':>7}  models")
        for w in stats.workers:
            lines.append(f"{w.worker_id[:23]:<24}{w.state[:9]:<10}{w.running:>8}{w.waiting:>8}{w.kv_usage:>9.0%}"
                         f"{w.free_kv_tokens:>10}{w.tokens_per_s:>9.1f}{_age(w.heartbeat_age_s):>7}  "
                         f"{', '.join(w.models)}")
            if w.loras is not None:
                lines.append(f"{'':<4}adapters loaded: {w.loras.shown()}   loads {w.loras.loads}   "
                             f"evictions {w.loras.evictions}")
    return "\n".join(lines + _tenant_lines(stats) + _tenant_view_lines(stats) + _adapter_lines(stats))


def _adapter_lines(stats: QueueStats) -> list[str]:
    """Per registered LoRA adapter: backlog, pending and oldest job (every priority), live workers holding it; those
    with the most backlog by name, the rest summed (limits.top_and_rest)."""
    v = stats.adapters
    if not v.registered:
        return []
    lines = ["", f"{'adapter':<32}{'base':<32}{'backlog':>10}{'pending':>10}{'oldest':>10}{'loaded on':>11}"]
    for a in v.top + ([v.other] if v.other.adapters else []):
        name = f"(other {a.adapters} adapters)" if a is v.other else a.adapter[:31]
        lines.append(f"{name:<32}{(a.base or '')[:31]:<32}{a.backlog:>10}{a.pending:>10}{_age(a.oldest_age_s):>10}"
                     f"{a.loaded_on:>11}")
    return lines


def _wait(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}s" if seconds < 1 else f"{seconds:.1f}s"


def _tenant_view_lines(stats: QueueStats) -> list[str]:
    """Per tenant: backlog (fair share only), running, tokens/s and queue wait over the workers' last minute; the
    busiest by name, the rest summed (limits.TOP_TENANTS, OTHER_TENANTS)."""
    v = stats.tenant_view
    rows = v.top + ([v.other] if v.other.backlog or v.other.running or v.other.tokens or any(v.other.waits) else [])
    if not rows:
        return []
    lines = ["", f"{'tenant':<32}{'backlog':>10}{'running':>9}{'tokens/s':>10}{'wait p50':>10}{'wait p99':>10}"]
    for t in rows:
        name = "(other tenants)" if t is v.other else t.tenant[:31]
        backlog = str(t.backlog) if v.backlog_by_tenant else "-"
        lines.append(f"{name:<32}{backlog:>10}{t.running:>9}{t.tokens_per_s:>10.1f}{_wait(t.wait_quantile(0.5)):>10}"
                     f"{_wait(t.wait_quantile(0.99)):>10}")
    if not v.backlog_by_tenant:
        lines.append("backlog per tenant: only with fair share on (shared streams are FIFO, with no per-tenant index)")
    return lines


def _tenant_lines(stats: QueueStats) -> list[str]:
    """Tenants under quotas: the busiest by name, the rest summed (jobs: queued or running; tokens: last minute)."""
    t = stats.tenants
    if not t.top and not (t.other.jobs or t.other.tokens_per_minute):
        return []
    lines = ["", f"{'tenant':<32}{'jobs':>10}{'tokens/min':>12}"]
    lines += [f"{u.tenant[:31]:<32}{u.jobs:>10}{u.tokens_per_minute:>12}" for u in t.top]
    if t.other.jobs or t.other.tokens_per_minute:
        lines.append(f"{'(other tenants)':<32}{t.other.jobs:>10}{t.other.tokens_per_minute:>12}")
    return lines


def _model_lines(m: ServedStats) -> list[str]:
    """A model's priorities with jobs, its total, and who serves it (or that nobody does; or, its own name served,
    that none of its workers has the adapter slots its adapters' jobs wait for)."""
    served = f"served by {len(m.workers)} worker(s): {', '.join(m.workers)}" if m.workers else "no live worker"
    if m.waiting_for_workers:
        served = f"{served}; {NO_SLOTS}" if m.workers else NO_WORKER
    lines = [f"{m.model[:31]:<32}{'':<10}{m.backlog:>10}{m.pending:>10}{'':>10}{_age(m.oldest_age_s):>10}  {served}"]
    for p in m.priorities.values():
        if p.length or p.backlog or p.pending:
            lines.append(f"{'':<32}{p.priority:<10}{p.backlog:>10}{p.pending:>10}{p.length:>10}"
                         f"{_age(p.oldest_age_s):>10}")
    return lines
