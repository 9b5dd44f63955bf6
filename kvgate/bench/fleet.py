"""W-FLEET: a simulated fleet of 1 to 64 mixed-size workers on one real redis-server, and on a Redis Cluster.

Three measurements:
- latency: for each fleet size and both admission policies (KV-capacity vs a naive fixed prefetch of 16),
  an open-loop stream of mixed jobs at `--load` of the fleet's estimated capacity; queue wait (enqueue to
  admission into an engine), end-to-end latency and fleet KV utilisation, from the final events in Redis.
- throughput: a backlog of one-token jobs drained by worker processes (the GIL would cap threads; throughput_fleet.py);
  jobs/s through the one Redis.
- cluster (fleet_cluster.py): the same backlog drained on one Redis and on a cluster of 3 primaries, turn by turn;
  jobs/s and Redis CPU per job on each primary against one Redis's.
Every job must get exactly one final event, or the run fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass

import redis

from kvgate.bench.fleet_cluster import TARGET_RATIO as TARGET_CLUSTER_RATIO
from kvgate.bench.queue import server_version
from kvgate.bench.throughput_fleet import backlog, drain_backlog, drain_stats
from kvgate.producer.keys import Keys

TARGET_JOBS_PER_S = 5000
TARGET_WAIT_RATIO = 0.5
TARGET_BARE_RATIO = 0.5  # kvgate's jobs/s over the bare Redis loop's, same run


@dataclass(slots=True)
class RunResult:
    policy: str
    workers: int
    jobs: int
    rate: float
    jobs_per_s: float
    p50_wait_s: float
    p99_wait_s: float
    p50_e2e_s: float
    p99_e2e_s: float
    kv_utilisation: float
    answered_once: bool


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fleet_capacity(specs, mix, step_overhead_s: float, per_token_s: float) -> float:
    """Jobs/s the fleet sustains when every worker runs what its KV cache holds (a rough cost model)."""
    tokens = sum(mix.prompt_tokens) / 2 + sum(mix.max_tokens) / 2
    steps = sum(mix.max_tokens) / 2
    total = 0.0
    for s in specs:
        concurrent = max(1.0, min(s.max_num_seqs, s.num_blocks * 16 / tokens))
        total += concurrent / (steps * (step_overhead_s + per_token_s * concurrent))
    return total


def _wait_answered(client: redis.Redis, keys: Keys, jobs, timeout: float) -> None:
    from kvgate.bench.fleet_sim import Answered

    deadline, answered = time.monotonic() + timeout, Answered(client, keys, list(jobs))
    while (done := answered.poll()) < len(jobs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {done} of {len(jobs)} jobs answered")
        time.sleep(0.1)


def run_latency(url: str, n_workers: int, policy: str, args) -> RunResult:
    from kvgate.bench import fleet_sim

    specs, mix = fleet_sim.mixed_fleet(n_workers), fleet_sim.JobMix()
    rate = args.load * fleet_capacity(specs, mix, args.step_ms / 1000, args.per_token_ms / 1000)
    n_jobs = max(20, min(args.jobs, int(rate * args.seconds)))
    clients = n_jobs // 2000 + 1  # reply streams are capped at 10k entries
    jobs = fleet_sim.make_jobs(n_jobs, mix, seed=args.seed, clients=clients)
    keys, client = Keys(f"wfleet-{policy}-{n_workers}-{time.time_ns()}"), redis.Redis.from_url(url)
    fleet = fleet_sim.start_fleet(url, keys.ns, specs, policy, step_overhead_s=args.step_ms / 1000,
                                  per_token_s=args.per_token_ms / 1000, seed=args.seed)
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.05):
            if any(w.flights for w in fleet.workers):
                fleet.sample_kv()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fleet_sim.enqueue(client, keys, jobs, rate=rate, batch=max(1, int(rate / 50)))
        _wait_answered(client, keys, jobs, timeout=120 + args.seconds * 4)
    finally:
        sampling.set()
        fleet.stop()
    return summarise(policy, n_workers, rate, jobs, fleet_sim.collect_finals(client, keys, clients), fleet.kv_samples)


def summarise(policy: str, n_workers: int, rate: float, jobs, finals: dict, kv_samples: list[float]) -> RunResult:
    once = len(finals) == len(jobs) and all(len(f) == 1 and f[0].status == "done" for f in finals.values())
    firsts = [f[0] for f in finals.values()]
    waits = [f.timings.admitted - f.timings.queued for f in firsts if f.timings.admitted]
    e2e = [f.timings.finished - f.timings.queued for f in firsts]
    span = max(f.timings.finished for f in firsts) - min(f.timings.queued for f in firsts)
    return RunResult(policy, n_workers, len(jobs), round(rate, 1), round(len(firsts) / span, 1),
                     round(percentile(waits, 0.5), 4), round(percentile(waits, 0.99), 4),
                     round(percentile(e2e, 0.5), 4), round(percentile(e2e, 0.99), 4),
                     round(statistics.fmean(kv_samples), 3) if kv_samples else 0.0, once)


def run_throughput(server, args) -> dict:
    """A backlog of one-token jobs, drained by `--procs` processes of 4 workers each: the queue path's ceiling.
    CPU seconds of Redis and of the workers are measured too: on a shared machine wall-clock jobs/s moves with
    the neighbours' load, jobs per CPU-second does not."""
    import resource

    from kvgate.bench import fleet_sim
    from kvgate.producer.redis_url import connect, keys_for

    url = server.url
    redis_cpu0 = server.cpu_seconds()
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    jobs, clients = backlog(args.throughput_jobs, args.seed)
    n, client = len(jobs), connect(url)
    keys = keys_for(url, client, f"wfleet-throughput-{time.time_ns()}")
    drain_backlog(url, client, keys, jobs, args.procs)
    redis_cpu = server.cpu_seconds() - redis_cpu0  # enqueue, reads, results and acks
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    worker_cpu = children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime
    drain = drain_stats(n, fleet_sim.collect_finals(client, keys, clients))
    from kvgate.bench.bare_loop import bare_loop_for

    bare = bare_loop_for(server, jobs, args.procs)
    return {"jobs": n, "processes": args.procs, "workers": args.procs * 4, "jobs_per_s": drain["jobs_per_s"],
            "bare_loop": bare, "ratio_to_bare_loop": round(drain["jobs_per_s"] / bare["jobs_per_s"], 3),
            "redis_cpu_s": round(redis_cpu, 2), "worker_cpu_s": round(worker_cpu, 2),
            "jobs_per_redis_cpu_s": round(n / max(redis_cpu, 1e-9), 1),
            "jobs_per_worker_cpu_s": round(n / max(worker_cpu, 1e-9), 1),
            "load_avg_1m": os.getloadavg()[0], "answered_once": drain["answered_once"]}


def plot(path: str, runs: list[RunResult], throughput: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    for policy, style in (("capacity", "o-"), ("prefetch", "s--")):
        rs = sorted((r for r in runs if r.policy == policy), key=lambda r: r.workers)
        xs = [r.workers for r in rs]
        ax1.plot(xs, [r.p99_wait_s for r in rs], style, label=f"{policy} p99")
        ax1.plot(xs, [r.p50_wait_s for r in rs], style, alpha=0.4, label=f"{policy} p50")
        ax2.plot(xs, [r.kv_utilisation for r in rs], style, label=policy)
        ax3.plot(xs, [r.jobs_per_s for r in rs], style, label=policy)
    ax1.set(title="queue wait (enqueue to admission)", xlabel="workers", ylabel="seconds", xscale="log", yscale="log")
    ax2.set(title="fleet KV utilisation while busy", xlabel="workers", ylabel="used / total blocks", xscale="log",
            ylim=(0, 1))
    drain = f"backlog drain, 1-token jobs: {throughput['jobs_per_s']:.0f}/s"
    ax3.set(title=f"completed jobs/s at the offered load\n({drain})",
            xlabel="workers", ylabel="jobs / (last finish - first enqueue)", xscale="log", yscale="log")
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("W-FLEET: KV-capacity admission vs fixed prefetch of 16, mixed fleet on one Redis")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_cost_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulated engine's cost model, as every fleet benchmark (W-FLEET, W-PREFIX, W-FAIR) takes it. Here, not in
    fleet_sim: `kvgate` builds every benchmark's flags at start-up, and fleet_sim imports the worker."""
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated step overhead (default 20 ms)")
    parser.add_argument("--per-token-ms", type=float, default=0.05, help="simulated cost per token (default 0.05)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG plot here (needs matplotlib and the latency runs)")
    parser.add_argument("--workers", default="1,4,16,64",
                        help="fleet sizes of the latency runs, comma-separated (default 1,4,16,64; '' = skip them)")
    parser.add_argument("--jobs", type=int, default=6000, help="most jobs per latency run (default 6000)")
    parser.add_argument("--seconds", type=float, default=8.0, help="arrival window per latency run (default 8)")
    parser.add_argument("--load", type=float, default=0.6, help="offered load / estimated capacity (default 0.6)")
    add_cost_model_arguments(parser)
    parser.add_argument("--throughput-jobs", type=int, default=30000, help="backlog for the jobs/s run (0 = skip)")
    parser.add_argument("--procs", type=int, default=max(2, min(4, os.cpu_count() or 2)),
                        help="worker processes for the jobs/s runs (4 workers each)")
    parser.add_argument("--cluster-primaries", type=int, default=3,
                        help="one Redis vs a cluster of this many primaries, Redis CPU per job (default 3; 0 = skip)")
    parser.add_argument("--cluster-replicas", type=int, default=0, help="replicas per primary (default 0)")
    parser.add_argument("--cluster-shards", type=int, default=0,
                        help="shards of the cluster's namespace (default 0: 2 per primary, as kvgate does)")
    parser.add_argument("--cluster-jobs", type=int, default=30000, help="backlog per contestant (default 30000)")
    parser.add_argument("--cluster-rounds", type=int, default=1, help="backlogs per contestant (default 1)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from kvgate.bench.fleet_sim import RedisProcess

    sizes = [int(w) for w in args.workers.split(",") if w.strip()]
    with RedisProcess() as server:
        url = server.url
        runs = []
        for n in sizes:
            for policy in ("capacity", "prefetch"):
                r = run_latency(url, n, policy, args)
                runs.append(r)
                print(json.dumps(asdict(r)), file=sys.stderr, flush=True)
        throughput = run_throughput(server, args) if args.throughput_jobs else {"jobs_per_s": 0.0}
        print(json.dumps({"throughput": throughput}), file=sys.stderr, flush=True)
        redis_version = server_version(url)
    cluster = {}
    if args.cluster_primaries:
        from kvgate.bench.fleet_cluster import run_cluster

        cluster = run_cluster(args)
        print(json.dumps({"cluster": cluster}), file=sys.stderr, flush=True)
    result = {
        "workload": "W-FLEET", "jobs_per_s": throughput["jobs_per_s"], **headline(runs),
        "answered_once": all(r.answered_once for r in runs) and throughput.get("answered_once", True)
        and cluster.get("answered_once", True),
        "throughput": throughput, "cluster": cluster, "runs": [asdict(r) for r in runs],
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)},
        "redis_version": redis_version, "cpus": os.cpu_count(),
        "targets": {"jobs_per_s": TARGET_JOBS_PER_S, "wait_ratio_p99_at_most": TARGET_WAIT_RATIO,
                    "ratio_to_bare_loop_at_least": TARGET_BARE_RATIO,
                    "cluster_cpu_per_job_ratio_at_most": TARGET_CLUSTER_RATIO},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.plot and runs:
        plot(args.plot, runs, throughput)
    return 0 if result["answered_once"] else 1


def headline(runs: list[RunResult]) -> dict:
    """Capacity admission vs prefetch at the largest fleet size of the latency runs (none: nothing)."""
    if not runs:
        return {}
    head = max(r.workers for r in runs)
    by = {(r.policy, r.workers): r for r in runs}
    cap, pre = by[("capacity", head)], by[("prefetch", head)]
    return {"p99_wait_s": {"capacity": cap.p99_wait_s, "prefetch": pre.p99_wait_s},
            "p50_wait_s": {"capacity": cap.p50_wait_s, "prefetch": pre.p50_wait_s},
            "kv_utilisation": {"capacity": cap.kv_utilisation, "prefetch": pre.kv_utilisation},
            "headline_workers": head,
            "wait_ratio_p99": round(cap.p99_wait_s / pre.p99_wait_s, 4) if pre.p99_wait_s else None}
