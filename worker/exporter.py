"""`kvfleet exporter`: queue and fleet gauges read from Redis at scrape time.

One process per kvfleet namespace is enough; it holds no state, so any number of replicas agree. The label is
`kvfleet_namespace` because Prometheus already puts the Kubernetes `namespace` on every target.
Lag on Redis 6.2 (no `lag` in XINFO GROUPS) is counted from the group's last-delivered id instead.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import redis
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily

from producer.protocol import PRIORITIES, Keys

LAG_COUNT_PAGE = 10_000


@dataclass(slots=True)
class StreamStats:
    priority: str
    length: int = 0
    lag: int = 0
    pending: int = 0
    oldest_age_s: float = 0.0


@dataclass(slots=True)
class WorkerBeat:
    worker_id: str
    state: str = "serving"
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 16
    admissible_tokens: int = 0
    tokens_per_s: float = 0.0
    jobs_done: int = 0


@dataclass(slots=True)
class FleetSnapshot:
    streams: list[StreamStats] = field(default_factory=list)
    workers: list[WorkerBeat] = field(default_factory=list)
    dead_letters: int = 0

    @property
    def free_kv_blocks(self) -> int:
        return sum(w.free_blocks for w in self.workers)

    @property
    def free_kv_tokens(self) -> int:
        return sum(w.free_blocks * w.block_size for w in self.workers)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _id_ms(entry_id) -> int:
    return int(_text(entry_id).split("-")[0])


def _count_after(client: redis.Redis, stream: str, last_id: str) -> int:
    """Entries after `last_id`: the lag, paged so a deep backlog never lands in one reply."""
    count, start = 0, f"({last_id}"
    while True:
        page = client.xrange(stream, min=start, max="+", count=LAG_COUNT_PAGE)
        count += len(page)
        if len(page) < LAG_COUNT_PAGE:
            return count
        start = f"({_text(page[-1][0])}"


def read_stream(client: redis.Redis, stream: str, priority: str, group: str, now_ms: int) -> StreamStats:
    stats = StreamStats(priority, length=client.xlen(stream))
    if stats.length == 0:
        return stats
    groups = {_text(g["name"]): g for g in client.xinfo_groups(stream)}
    info = groups.get(group)
    oldest_ms: list[int] = []
    if info is None:  # nobody has read yet: everything is backlog
        stats.lag = stats.length
        first = client.xrange(stream, count=1)
        oldest_ms += [_id_ms(first[0][0])] if first else []
    else:
        last = _text(info["last-delivered-id"])
        lag = info.get("lag")
        stats.lag = int(lag) if lag is not None else _count_after(client, stream, last)
        stats.pending = int(info["pending"])
        if stats.pending:
            summary = client.xpending(stream, group)
            oldest_ms.append(_id_ms(summary["min"]))
        nxt = client.xrange(stream, min=f"({last}", max="+", count=1)
        oldest_ms += [_id_ms(nxt[0][0])] if nxt else []
    if oldest_ms:
        stats.oldest_age_s = max(0.0, (now_ms - min(oldest_ms)) / 1000)
    return stats


def _beat(raw: dict) -> WorkerBeat:
    f = {_text(k): _text(v) for k, v in raw.items()}
    return WorkerBeat(
        worker_id=f.get("worker_id", "?"), state=f.get("state", "serving"),
        running=int(f.get("running", 0)), waiting=int(f.get("waiting", 0)),
        free_blocks=int(f.get("free_blocks", 0)), total_blocks=int(f.get("total_blocks", 0)),
        block_size=int(f.get("block_size", 16)), admissible_tokens=int(f.get("admissible_tokens", 0)),
        tokens_per_s=float(f.get("tokens_per_s", 0.0)), jobs_done=int(f.get("jobs_done", 0)))


def read_workers(client: redis.Redis, keys: Keys) -> list[WorkerBeat]:
    """Heartbeat hashes expire with their worker, so every key still present is a live worker."""
    names = sorted(client.scan_iter(match=keys.worker_pattern(), count=500))
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    return [_beat(raw) for raw in pipe.execute() if raw]


def read_fleet(client: redis.Redis, keys: Keys) -> FleetSnapshot:
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000  # the server's clock: the one stream ids are stamped with
    streams = [read_stream(client, keys.jobs(p), p, Keys.GROUP, now_ms) for p in PRIORITIES]
    return FleetSnapshot(streams, read_workers(client, keys), dead_letters=client.xlen(keys.dead()))


class FleetCollector:
    """A Prometheus collector that asks Redis at each scrape, so the figures are never stale."""

    def __init__(self, client: redis.Redis, keys: Keys):
        self.client, self.keys = client, keys

    def collect(self):
        ns = self.keys.ns
        up = GaugeMetricFamily("kvfleet_exporter_redis_up", "1 if the last scrape could read Redis",
                               labels=["kvfleet_namespace"])
        started = time.perf_counter()
        try:
            snap = read_fleet(self.client, self.keys)
        except redis.RedisError:
            up.add_metric([ns], 0)
            yield up
            return
        up.add_metric([ns], 1)
        yield up
        yield from _stream_families(ns, snap.streams)
        yield from _fleet_families(ns, snap)
        took = GaugeMetricFamily("kvfleet_exporter_scrape_seconds", "Time to read the fleet from Redis",
                                 labels=["kvfleet_namespace"])
        took.add_metric([ns], time.perf_counter() - started)
        yield took


def _stream_families(ns: str, streams: list[StreamStats]):
    specs = (("queue_lag", "Jobs in the stream not yet delivered to any worker", "lag"),
             ("queue_pending", "Jobs delivered to a worker and not yet acknowledged", "pending"),
             ("queue_length", "Entries in the job stream (XLEN)", "length"),
             ("queue_oldest_job_age_seconds", "Age of the oldest job not yet acknowledged", "oldest_age_s"))
    for name, doc, attr in specs:
        family = GaugeMetricFamily(f"kvfleet_{name}", doc, labels=["kvfleet_namespace", "priority"])
        for s in streams:
            family.add_metric([ns, s.priority], getattr(s, attr))
        yield family


def _fleet_families(ns: str, snap: FleetSnapshot):
    draining = sum(w.state == "draining" for w in snap.workers)
    specs = (("live_workers", "Workers with an unexpired heartbeat", len(snap.workers)),
             ("draining_workers", "Live workers that are draining", draining),
             ("fleet_free_kv_blocks", "Free KV blocks summed over live workers", snap.free_kv_blocks),
             ("fleet_free_kv_tokens", "Free KV capacity in tokens summed over live workers", snap.free_kv_tokens),
             ("fleet_total_kv_blocks", "KV blocks summed over live workers", sum(w.total_blocks for w in snap.workers)),
             ("fleet_admissible_tokens", "Prompt tokens the fleet could admit now",
              sum(w.admissible_tokens for w in snap.workers)),
             ("fleet_running_jobs", "Jobs running on live workers", sum(w.running for w in snap.workers)),
             ("dead_stream_length", "Entries in the dead-letter stream", snap.dead_letters))
    for name, doc, value in specs:
        family = GaugeMetricFamily(f"kvfleet_{name}", doc, labels=["kvfleet_namespace"])
        family.add_metric([ns], value)
        yield family


def build_registry(client: redis.Redis, keys: Keys) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(FleetCollector(client, keys))
    return registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=int(os.environ.get("KVFLEET_EXPORTER_PORT", "9400")),
                        help="HTTP port for /metrics (env KVFLEET_EXPORTER_PORT, default 9400)")
    parser.add_argument("--addr", default=os.environ.get("KVFLEET_EXPORTER_ADDR", "0.0.0.0"),
                        help="address to bind (default 0.0.0.0)")


def run(args: argparse.Namespace) -> int:
    url = args.redis_url or "redis://localhost:6379/0"
    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    server, _ = start_http_server(args.port, addr=args.addr, registry=build_registry(client, Keys(args.namespace)))
    print(f"kvfleet exporter: http://{args.addr}:{server.server_port}/metrics for namespace {args.namespace}",
          flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0
