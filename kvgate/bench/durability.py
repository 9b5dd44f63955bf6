"""W-DURABILITY: what the replicated durability costs. A primary and one replica on loopback; the SDK's submit
and the worker's finish (the publisher's script, one job per round trip) are timed one at a time, with and without
WAIT 1, in alternating rounds so both modes see the same machine load.

A submit in replicated mode also goes through an idempotency claim (so that it can be resent): its cost includes
that script, not only the WAIT. Loopback replication is the best case; across zones add a network round trip.
`--cluster`: the same on a Redis Cluster of 3 primaries with a replica each, where the replicated writes go on a
link of their own to the shard's primary (kvgate.producer.cluster.NodeLinks).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import redis

from kvgate.bench.queue import server_version
from kvgate.redis_cluster import ClusterGroup
from kvgate.redis_server import RedisServer, find_redis_server

MODES = ("primary", "replicated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=int, default=500, help="submits and finishes timed per mode and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both modes")
    parser.add_argument("--cluster", action="store_true", help="on a Redis Cluster of 3 primaries with a replica each")
    parser.add_argument("--json", type=Path, help="write the report here")


def start_pair(folder: Path) -> tuple[list[RedisServer], str]:
    """A primary and its replica (append-only, fsync every second: Redis's usual durable setting)."""
    binary, durable = shutil.which("redis-server") or find_redis_server(), ("--appendfsync", "everysec")
    primary = RedisServer(folder / "n0", binary, extra_args=durable).start()
    replica = RedisServer(folder / "n1", binary, extra_args=(*durable, "--replicaof", "127.0.0.1", str(primary.port)))
    servers = [primary, replica.start()]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if replica.client().info("replication").get("master_link_status") == "up":
                return servers, primary.url
        except redis.ConnectionError:
            pass
        time.sleep(0.05)
    for server in servers:
        server.stop(9)
    raise RuntimeError("the replica did not sync with its primary within 20 s")


def start_cluster(folder: Path) -> tuple[list[RedisServer], str]:
    """A cluster of 3 primaries with a replica each, its nodes as start_pair gives its servers."""
    group = ClusterGroup(folder, primaries=3, replicas=1).start()
    return group.nodes, group.url


def time_submits(url: str, mode: str, jobs: int) -> list[float]:
    from kvgate.producer import Client

    with Client(url, f"wdur-{uuid.uuid4().hex[:8]}", durability=mode) as client:
        client.submit("warm up", max_tokens=1)
        out = []
        for i in range(jobs):
            t = time.perf_counter()
            client.submit(f"job {i}", max_tokens=1)
            out.append(time.perf_counter() - t)
    return out


def time_finishes(url: str, mode: str, jobs: int) -> list[float]:
    """The worker's finish, as it runs it: the publisher's script (result, reply, ack), plus WAIT when replicated."""
    from kvgate.producer.keys import Keys, as_text
    from kvgate.producer.protocol import PROTOCOL_VERSION, FIELD, Final, Timings
    from kvgate.producer.redis_url import Durability
    from kvgate.worker.publisher import Finish, Publisher

    from kvgate.producer.cluster import NodeLinks
    from kvgate.producer.redis_url import connect, keys_for

    r = connect(url)
    keys = keys_for(url, r, f"wdur-{uuid.uuid4().hex[:8]}")
    stream = keys.jobs(None, "normal")
    r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    entries = [as_text(r.xadd(stream, {FIELD: b"x"})) for _ in range(jobs)]
    r.xreadgroup(Keys.GROUP, "bench", {stream: ">"}, count=jobs)
    links = NodeLinks(r, url) if keys.cluster and mode == "replicated" else None
    publisher = Publisher(r, keys, 3600, 3600, 10_000, 1000, durability=Durability(mode), links=links)
    out = []
    for i, entry in enumerate(entries):
        final = Final(v=PROTOCOL_VERSION, job_id=f"j{i}", status="done", text="ok", worker="bench",
                      timings=Timings(queued=time.time()))
        publisher.finish(Finish(final, "bench-client", stream, entry))
        t = time.perf_counter()
        publisher.flush()
        out.append(time.perf_counter() - t)
    return out


def summary(samples: list[float]) -> dict:
    ms = sorted(s * 1000 for s in samples)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 3), "p99_ms": round(ms[int(len(ms) * 0.99) - 1], 3),
            "mean_ms": round(statistics.fmean(ms), 3)}


def run(args: argparse.Namespace) -> int:
    samples = {(kind, mode): [] for kind in ("submit", "finish") for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="kvgate-wdur-") as folder:
        servers, url = start_cluster(Path(folder)) if args.cluster else start_pair(Path(folder))
        try:
            for _ in range(args.rounds):
                for mode in MODES:
                    samples["submit", mode] += time_submits(url, mode, args.jobs)
                    samples["finish", mode] += time_finishes(url, mode, args.jobs)
            version = server_version(url)
        finally:
            for server in servers:
                server.stop(9)  # nothing here needs keeping
    report = {"redis": version, "jobs": args.jobs, "rounds": args.rounds, "cluster": args.cluster,
              **{f"{kind}_{mode}": summary(s) for (kind, mode), s in samples.items()}}
    where = "3 primaries + 1 replica each (Redis Cluster)" if args.cluster else "primary + 1 replica"
    print(f"W-DURABILITY, redis {version}, {where} on loopback, {args.rounds} x {args.jobs} per cell")
    print(f"{'':8} {'primary p50/p99 ms':>20} {'replicated p50/p99 ms':>24}")
    for kind in ("submit", "finish"):
        a, b = report[f"{kind}_primary"], report[f"{kind}_replicated"]
        print(f"{kind:8} {a['p50_ms']:>9.3f} / {a['p99_ms']:<8.3f} {b['p50_ms']:>12.3f} / {b['p99_ms']:<8.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0
