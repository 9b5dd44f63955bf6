"""`kvgate stats`: backlog, pending and oldest age per priority, and the live workers."""
from __future__ import annotations

import argparse
import json

from ..connection import DEFAULT_URL, resolve_url, translated
from ..protocol import Keys
from ..queue_stats import QueueStats, read_queue_stats
from ..redis_url import connect


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run(args: argparse.Namespace) -> int:
    url = resolve_url(args.redis_url, DEFAULT_URL)
    with translated(url):
        r = connect(url)
        stats = read_queue_stats(r, Keys(args.namespace))
        r.close()
    print(json.dumps(stats.to_dict()) if args.json else render(stats, args.namespace))
    return 0


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def render(stats: QueueStats, namespace: str) -> str:
    lines = [f"namespace {namespace}", "",
             f"{'priority':<10}{'backlog':>10}{'pending':>10}{'length':>10}{'oldest':>10}"]
    for p in stats.priorities.values():
        lines.append(f"{p.priority:<10}{p.backlog:>10}{p.pending:>10}{p.length:>10}{_age(p.oldest_age_s):>10}")
    lines.append(f"{'total':<10}{stats.backlog:>10}{stats.pending:>10}{'':>10}{_age(stats.oldest_age_s):>10}")
    lines += ["", f"live workers: {len(stats.workers)}   free KV tokens: {stats.free_kv_tokens}   "
                  f"dead letters: {stats.dead}"]
    if stats.workers:
        lines.append(f"{'worker':<24}{'state':<10}{'running':>8}{'waiting':>8}{'KV used':>9}{'free tok':>10}"
                     f"{'tok/s':>9}{'beat':>7}")
        for w in stats.workers:
            lines.append(f"{w.worker_id[:23]:<24}{w.state[:9]:<10}{w.running:>8}{w.waiting:>8}{w.kv_usage:>9.0%}"
                         f"{w.free_kv_tokens:>10}{w.tokens_per_s:>9.1f}{_age(w.heartbeat_age_s):>7}")
    return "\n".join(lines)
