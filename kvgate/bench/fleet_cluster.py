"""W-FLEET on a Redis Cluster (issue #16): the throughput fleet of `kvgate bench fleet` (throughput_fleet.py: worker
processes draining a backlog of one-token jobs) on one Redis and on a cluster of `--cluster-primaries` primaries, in
turn.

Both run the same redis-server binary with the same settings (no append-only file; replicas only with
`--cluster-replicas`). Wall-clock jobs/s cannot show scaling on a 2-core machine, so what this measures is the Redis
CPU a job costs: INFO cpu (used_cpu_sys + used_cpu_user) before and after the run on every primary, divided by the
jobs that primary handled (the jobs whose shard's slot it holds). If each primary's cost per job stays within 1.2x
of one Redis's, capacity grows with the number of primaries. Every job must get exactly one final event on both.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from kvgate.redis_cluster import ClusterGroup
from kvgate.redis_server import RedisServer, redis_major, redis_server_binary

TARGET_RATIO = 1.2  # a primary's Redis CPU per job over one Redis's
NO_PERSISTENCE = ("--appendonly", "no")  # the bench measures the queue path, as W-FLEET's single Redis does
IDLE_S = 2.0


def cluster_unavailable() -> str | None:
    """Why the cluster contestant cannot run here, or None."""
    if not shutil.which("redis-cli"):
        return "redis-cli is not on the PATH (redis-cli --cluster create makes the cluster)"
    if redis_major(redis_server_binary()) < 7:
        return "the cluster contestant needs redis-server >= 7 on the PATH"
    return None


def cpu_seconds(node: RedisServer) -> float:
    """CPU the server process has used so far, as it reports it (INFO cpu)."""
    client = node.client()
    try:
        info = client.info("cpu")
    finally:
        client.close()
    return info["used_cpu_sys"] + info["used_cpu_user"]


def idle_cpu_per_s(nodes: list[RedisServer], seconds: float = IDLE_S) -> dict[int, float]:
    """Each node's CPU-seconds per second with no clients working: cron, and on a cluster the bus's pings."""
    before = {n.port: cpu_seconds(n) for n in nodes}
    time.sleep(seconds)
    return {n.port: round((cpu_seconds(n) - before[n.port]) / seconds, 5) for n in nodes}


def drain_on(url: str, nodes: list[RedisServer], owner_of, args) -> dict:
    """One backlog drained through `url`; Redis CPU per node and the jobs each node handled (`owner_of(keys, job)`
    is the port of the primary holding the job's shard)."""
    from kvgate.bench.throughput_fleet import backlog, drain_backlog, drain_stats
    from kvgate.bench.fleet_sim import collect_finals
    from kvgate.producer.redis_url import connect, keys_for

    client = connect(url)
    try:
        keys = keys_for(url, client, f"wfleet-cluster-{time.time_ns()}")
        jobs, clients = backlog(args.cluster_jobs, args.seed)
        cpu0 = {n.port: cpu_seconds(n) for n in nodes}
        started = time.monotonic()
        drain_backlog(url, client, keys, jobs, args.procs)
        wall = time.monotonic() - started
        cpu = {n.port: cpu_seconds(n) - cpu0[n.port] for n in nodes}
        stats = drain_stats(len(jobs), collect_finals(client, keys, clients))
        handled = Counter(owner_of(keys, job) for job in jobs)
    finally:
        client.close()
    return {"jobs": len(jobs), "shards": len(keys.parts), "wall_s": round(wall, 2), **stats,
            "per_node": {port: {"jobs": handled[port], "redis_cpu_s": round(cpu[port], 4)} for port in cpu}}


@contextlib.contextmanager
def one_redis(workdir: Path):
    """The single-Redis contestant: (url, the nodes whose CPU counts, owner_of)."""
    server = RedisServer(workdir / "single", extra_args=NO_PERSISTENCE).start()
    try:
        yield server.url, [server], lambda keys, job: server.port
    finally:
        server.stop()


@contextlib.contextmanager
def redis_cluster(args, workdir: Path):
    """The cluster contestant: its primaries, and the primary each job's shard lives on."""
    group = ClusterGroup(workdir / "cluster", primaries=args.cluster_primaries, replicas=args.cluster_replicas,
                         extra_args=NO_PERSISTENCE).start()
    owners: dict[str, int] = {}

    def owner_of(keys, job) -> int:
        stream = keys.jobs(None, "normal", shard=keys.shard_of(job.job_id))
        if stream not in owners:
            owners[stream] = group.node_of(stream).port
        return owners[stream]

    try:
        url = group.url + (f"?shards={args.cluster_shards}" if args.cluster_shards else "")
        yield url, group.primary_nodes(), owner_of
    finally:
        group.stop()


def per_job(runs: list[dict]) -> dict[int, dict]:
    """Each node's jobs, Redis CPU and microseconds of Redis CPU per job, over every round."""
    out: dict[int, dict] = {}
    for run in runs:
        for port, node in run["per_node"].items():
            acc = out.setdefault(port, {"jobs": 0, "redis_cpu_s": 0.0})
            acc["jobs"] += node["jobs"]
            acc["redis_cpu_s"] += node["redis_cpu_s"]
    for acc in out.values():
        acc["redis_cpu_s"] = round(acc["redis_cpu_s"], 4)
        acc["cpu_us_per_job"] = round(acc["redis_cpu_s"] / max(acc["jobs"], 1) * 1e6, 2)
    return out


def compare(one: dict, many: dict) -> dict:
    """The headline: jobs/s of each, one Redis's CPU per job, each primary's, and the worst primary's ratio."""
    base = next(iter(per_job(one["runs"]).values()))
    primaries = per_job(many["runs"])
    ratios = {port: round(p["cpu_us_per_job"] / base["cpu_us_per_job"], 3) for port, p in primaries.items()}
    total_cpu = sum(p["redis_cpu_s"] for p in primaries.values())
    total_jobs = sum(p["jobs"] for p in primaries.values())
    worst = max(ratios.values())
    rounds = [max(p["cpu_us_per_job"] for p in per_job([c]).values()) /
              next(iter(per_job([o]).values()))["cpu_us_per_job"] for o, c in zip(one["runs"], many["runs"])]
    return {
        "single": {"jobs_per_s": [r["jobs_per_s"] for r in one["runs"]], **base},
        "cluster": {"jobs_per_s": [r["jobs_per_s"] for r in many["runs"]], "shards": many["runs"][0]["shards"],
                    "primaries": primaries, "cpu_us_per_job_all_primaries": round(total_cpu / total_jobs * 1e6, 2)},
        "ratio_per_primary": ratios, "worst_ratio": worst,
        "worst_ratio_by_round": [round(r, 3) for r in rounds], "target_ratio_at_most": TARGET_RATIO,
        "met": worst <= TARGET_RATIO,
        "answered_once": all(r["answered_once"] for r in one["runs"] + many["runs"]),
    }


def run_cluster(args) -> dict:
    """Both contestants up at once and their rounds alternated (one Redis, then the cluster), so that both see the
    same load from the machine's other users; `skipped` says why when the cluster cannot run here."""
    why = cluster_unavailable()
    if why:
        return {"skipped": why, "answered_once": True}
    with tempfile.TemporaryDirectory(prefix="kvgate-wfleet-cluster-") as tmp, \
            one_redis(Path(tmp)) as single, redis_cluster(args, Path(tmp)) as cluster:
        idle = {"single": idle_cpu_per_s(single[1]), "cluster": idle_cpu_per_s(cluster[1])}
        one, many = {"runs": []}, {"runs": []}
        for _ in range(args.cluster_rounds):
            one["runs"].append(drain_on(*single, args))
            many["runs"].append(drain_on(*cluster, args))
        version = single[1][0].version()
    return {**compare(one, many), "redis_version": version, "idle_cpu_per_s": idle,
            "runs": {"single": one["runs"], "cluster": many["runs"]}}
