"""W-DURABILITY: what the replicated durability costs. A primary and one replica on loopback; the SDK's submit
and the worker's finish (the publisher's script, one job per round trip) are timed one at a time, with and without
WAIT 1, in alternating rounds so both modes see the same machine load.

A submit in replicated mode also goes through an idempotency claim (so that it can be resent): its cost includes
that script, not only the WAIT. Loopback replication is the best case; across zones add a network round trip.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import redis

from kvgate.bench.queue import server_version

MODES = ("primary", "replicated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=int, default=500, help="submits and finishes timed per mode and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both modes")
    parser.add_argument("--json", type=Path, help="write the report here")


def start_pair(folder: Path) -> tuple[list[subprocess.Popen], str]:
    """A primary and its replica (append-only, fsync every second: Redis's usual durable setting)."""
    from kvgate.worker.embedded_redis import find_redis_server, free_port

    binary, ports, procs = shutil.which("redis-server") or find_redis_server(), [free_port(), free_port()], []
    for i, port in enumerate(ports):
        (folder / f"n{i}").mkdir()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder / f"n{i}"),
                "--appendonly", "yes", "--save", "", "--logfile", "redis.log"]
        procs.append(subprocess.Popen(args + (["--replicaof", "127.0.0.1", str(ports[0])] if i else []),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    replica = redis.Redis(port=ports[1])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if replica.info("replication").get("master_link_status") == "up":
                return procs, f"redis://127.0.0.1:{ports[0]}/0"
        except redis.ConnectionError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the replica did not sync with its primary within 20 s")


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
    from kvgate.producer.protocol import PROTOCOL_VERSION, FIELD, Final, Keys, Timings
    from kvgate.producer.redis_url import Durability
    from kvgate.worker.publisher import Finish, Publisher

    r, keys = redis.Redis.from_url(url), Keys(f"wdur-{uuid.uuid4().hex[:8]}")
    stream = keys.jobs(None, "normal")
    r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    entries = [r.xadd(stream, {FIELD: b"x"}).decode() for _ in range(jobs)]
    r.xreadgroup(Keys.GROUP, "bench", {stream: ">"}, count=jobs)
    publisher = Publisher(r, keys, 3600, 3600, 10_000, 1000, durability=Durability(mode))
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
        procs, url = start_pair(Path(folder))
        try:
            for _ in range(args.rounds):
                for mode in MODES:
                    samples["submit", mode] += time_submits(url, mode, args.jobs)
                    samples["finish", mode] += time_finishes(url, mode, args.jobs)
            version = server_version(url)
        finally:
            for proc in procs:
                proc.kill()  # nothing here needs keeping
                proc.wait(10)
    report = {"redis": version, "jobs": args.jobs, "rounds": args.rounds,
              **{f"{kind}_{mode}": summary(s) for (kind, mode), s in samples.items()}}
    print(f"W-DURABILITY, redis {version}, primary + 1 replica on loopback, {args.rounds} x {args.jobs} per cell")
    print(f"{'':8} {'primary p50/p99 ms':>20} {'replicated p50/p99 ms':>24}")
    for kind in ("submit", "finish"):
        a, b = report[f"{kind}_primary"], report[f"{kind}_replicated"]
        print(f"{kind:8} {a['p50_ms']:>9.3f} / {a['p99_ms']:<8.3f} {b['p50_ms']:>12.3f} / {b['p99_ms']:<8.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0
