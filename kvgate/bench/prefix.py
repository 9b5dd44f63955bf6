"""W-PREFIX: prefix-affinity lanes against one shared stream, on a simulated mixed fleet and one real Redis.

Jobs draw a system prompt from `--prefixes` prefixes of 1,024 tokens with Zipf(1.1) popularity, plus a unique
32-256-token suffix and 16-256 output tokens. Three contestants see the same jobs:
- shared: today's layout, every worker reads one stream per priority;
- lanes: the same fleet with `affinity="on"` (producer/lanes.py, worker/affinity.py);
- ideal: one worker with the whole fleet's KV blocks and batch slots, the upper bound on prefix hits.
Each runs twice: a backlog drained as fast as it can (jobs/s at saturation), then an open-loop arrival stream at
`--load` of the shared stream's saturation rate (queue wait, prefix hit rate, prefill tokens computed). The
engine is the production one over a cost-model runner: prefill tokens cost time, prefix-cache hits do not.

Besides the targets, each saturation run reports where its jobs/s comes from (not a target): `running`, the mean
running sequences per worker of each size class while jobs still waited in Redis, and `backlog_s`, how long that
lasted. jobs/s at saturation counts from the first enqueue to the last answer, so it also holds the drain's tail
(the last jobs read run up to 256 steps on emptying workers, ~5 s at --speed 1, whatever the placement).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import redis

from kvgate.bench.queue import server_version
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import PROTOCOL_VERSION, Job, Sampling

TARGETS = {"hit_rate_to_ideal_at_least": 0.9, "prefill_to_shared_at_most": 0.5, "p99_wait_to_shared_at_most": 1.2,
           "saturation_to_shared_at_least": 1.5}


@dataclass(slots=True)
class PrefixMix:
    prefixes: int = 32
    prefix_tokens: int = 1024
    zipf: float = 1.1
    suffix_tokens: tuple[int, int] = (32, 256)
    max_tokens: tuple[int, int] = (16, 256)


@dataclass(slots=True)
class Outcome:
    contestant: str
    phase: str  # saturation | open-loop
    jobs: int
    rate: float | None
    jobs_per_s: float
    hit_rate: float  # cached prompt tokens / prompt tokens, over the whole fleet
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens computed (not served from a prefix cache)
    p50_wait_s: float
    p99_wait_s: float
    steals: int
    answered_once: bool
    backlog_s: float | None = None  # saturation: from the first enqueue until no job waited in Redis
    running: dict[str, float] = field(default_factory=dict)  # saturation: mean running sequences per worker, by size


@dataclass(slots=True)
class Concurrency:
    """Samples a fleet every 50 ms until every job is inside a worker (running, waiting locally or done)."""

    fleet: object
    jobs: int
    started: float = field(default_factory=time.monotonic)
    backlog_s: float | None = None
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            workers = self.fleet.workers
            if sum(w.answers.jobs_done + len(w.flights) + len(w.queue) for w in workers) >= self.jobs:
                self.backlog_s = round(time.monotonic() - self.started, 2)
                return
            for w in workers:
                size = w.worker_id.split("-")[0]
                self.sums[size] = self.sums.get(size, 0.0) + w.engine.stats.running
                self.counts[size] = self.counts.get(size, 0) + 1

    def finish(self, thread: threading.Thread) -> None:
        """Every job is answered, so none waits in Redis now: a backlog the 50 ms samples did not see end (the last
        jobs answered within one interval) ended by this moment."""
        self.stop.set()
        thread.join()
        if self.backlog_s is None:
            self.backlog_s = round(time.monotonic() - self.started, 2)

    def means(self) -> dict[str, float]:
        return {size: round(total / self.counts[size], 2) for size, total in sorted(self.sums.items())}


def make_prefix_jobs(n: int, mix: PrefixMix, *, seed: int, clients: int) -> list[Job]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 32000) for _ in range(mix.prefix_tokens)] for _ in range(mix.prefixes)]
    weights = [1 / (k + 1) ** mix.zipf for k in range(mix.prefixes)]
    jobs = []
    for i in range(n):
        prefix = rng.choices(prefixes, weights)[0]
        suffix = [rng.randrange(1, 32000) for _ in range(rng.randint(*mix.suffix_tokens))]
        sampling = Sampling(max_tokens=rng.randint(*mix.max_tokens), ignore_eos=True, temperature=0.0)
        jobs.append(Job(v=PROTOCOL_VERSION, job_id=f"j{i}", client_id=f"bench-{i % clients}", enqueued_at=0.0,
                        prompt_token_ids=prefix + suffix, sampling=sampling))
    return jobs


def contestant_fleet(name: str, n_workers: int) -> list:
    from kvgate.bench.fleet_sim import WorkerSpec, mixed_fleet

    specs = mixed_fleet(n_workers)
    if name != "ideal":
        return specs
    return [WorkerSpec("ideal-0", sum(s.num_blocks for s in specs), sum(s.max_num_seqs for s in specs))]


def _steals(fleet) -> int:
    total = 0.0
    for w in fleet.workers:
        registry = getattr(w.metrics, "registry", None)
        if registry is not None:
            total += registry.get_sample_value("kvgate_affinity_steals_total", w.metrics.labels) or 0.0
    return int(total)


def wait_for_ring(client: redis.Redis, keys: Keys, members: int, timeout: float = 15.0) -> int:
    """Lanes on: wait until the namespace has its count and every worker is in the ring, so ownership is settled
    before the first job (as in a fleet that has been up a while)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lanes = client.get(keys.lanes())
        if lanes is not None and client.zcard(keys.lane_ring(None)) >= members:
            time.sleep(1.5)  # one more heartbeat: every worker recomputes its lanes with the full ring
            return int(lanes)
        time.sleep(0.1)
    raise TimeoutError(f"the lane ring has {client.zcard(keys.lane_ring(None))} of {members} workers after {timeout}s")


def run_contestant(url: str, name: str, phase: str, jobs: list[Job], rate: float | None, args) -> Outcome:
    from kvgate.bench import fleet_sim
    from kvgate.bench.fleet import _wait_answered, percentile

    specs = contestant_fleet(name, args.workers)
    keys, client = Keys(f"wprefix-{name}-{phase}-{time.time_ns()}"), redis.Redis.from_url(url)
    clients = len(jobs) // 2000 + 1
    settings = {"affinity": "on", "affinity_lanes": args.lanes, "affinity_steal_age_ms": args.steal_age_ms,
                "affinity_max_lag_ms": args.max_lag_ms} if name == "lanes" else {}
    fleet = fleet_sim.start_fleet(url, keys.ns, specs, "capacity", step_overhead_s=args.step_ms / 1000 / args.speed,
                                  per_token_s=args.per_token_ms / 1000 / args.speed, seed=args.seed, **settings)
    sampler = None
    try:
        lanes = wait_for_ring(client, keys, len(specs)) if name == "lanes" else 0
        if phase == "saturation":
            sampler = Concurrency(fleet, len(jobs))
            sampling = threading.Thread(target=sampler.run, daemon=True)
            sampling.start()
        fleet_sim.enqueue(client, keys, jobs, rate=rate, batch=max(1, int((rate or 1000) / 50)), lanes=lanes)
        _wait_answered(client, keys, jobs, timeout=120 + len(jobs) / 5)
    finally:
        if sampler is not None:
            sampler.finish(sampling)
        fleet.stop()
    finals = fleet_sim.collect_finals(client, keys, clients)
    once = len(finals) == len(jobs) and all(len(f) == 1 and f[0].status == "done" for f in finals.values())
    firsts = [f[0] for f in finals.values()]
    prompt = sum(f.usage.prompt_tokens for f in firsts)
    cached = sum(f.usage.cached_tokens for f in firsts)
    waits = [f.timings.admitted - f.timings.queued for f in firsts if f.timings.admitted]
    start = min(f.timings.queued for f in firsts)
    span = max(f.timings.finished for f in firsts) - start
    return Outcome(name, phase, len(jobs), round(rate, 2) if rate else None, round(len(firsts) / span, 2),
                   round(cached / max(prompt, 1), 4), prompt, prompt - cached, round(percentile(waits, 0.5), 4),
                   round(percentile(waits, 0.99), 4), _steals(fleet), once,
                   sampler.backlog_s if sampler else None, sampler.means() if sampler else {})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvgate.bench.fleet import add_cost_model_arguments

    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--workers", type=int, default=16, help="fleet size, mixed as W-FLEET's (default 16)")
    parser.add_argument("--lanes", type=int, default=32, help="affinity lanes of the lanes contestant (default 32)")
    parser.add_argument("--steal-age-ms", type=int, default=100, help="the lanes' affinity_steal_age_ms (default 100)")
    parser.add_argument("--max-lag-ms", type=int, default=1000, help="the lanes' affinity_max_lag_ms (default 1000)")
    parser.add_argument("--prefixes", type=int, default=32, help="distinct 1,024-token system prompts (default 32)")
    parser.add_argument("--saturation-jobs", type=int, default=1200, help="backlog per saturation run (default 1200)")
    parser.add_argument("--seconds", type=float, default=20.0, help="open-loop arrival window (default 20)")
    parser.add_argument("--load", type=float, default=0.7,
                        help="open-loop rate as a fraction of the shared stream's saturation jobs/s (default 0.7)")
    add_cost_model_arguments(parser)
    parser.add_argument("--speed", type=float, default=1.0,
                        help="divide the cost model's times by this (a shorter run; the ratios hold while the "
                             "machine keeps up, default 1)")
    parser.add_argument("--seed", type=int, default=0)


def ratios(by: dict[tuple[str, str], Outcome]) -> dict:
    shared, lanes, ideal = (by[(c, "open-loop")] for c in ("shared", "lanes", "ideal"))
    sat = {c: by[(c, "saturation")].jobs_per_s for c in ("shared", "lanes")}
    return {"hit_rate_to_ideal": round(lanes.hit_rate / ideal.hit_rate, 3) if ideal.hit_rate else None,
            "prefill_to_shared": round(lanes.prefill_tokens / max(shared.prefill_tokens, 1), 3),
            "p99_wait_to_shared": round(lanes.p99_wait_s / shared.p99_wait_s, 3) if shared.p99_wait_s else None,
            "saturation_to_shared": round(sat["lanes"] / sat["shared"], 3) if sat["shared"] else None}


def run(args: argparse.Namespace) -> int:
    from kvgate.bench.fleet_sim import RedisProcess

    mix = PrefixMix(prefixes=args.prefixes)
    runs: list[Outcome] = []
    with RedisProcess() as server:
        backlog = make_prefix_jobs(args.saturation_jobs, mix, seed=args.seed, clients=args.saturation_jobs // 2000 + 1)
        for name in ("shared", "lanes", "ideal"):
            runs.append(run_contestant(server.url, name, "saturation", [_copy(j) for j in backlog], None, args))
            print(json.dumps(asdict(runs[-1])), file=sys.stderr, flush=True)
        rate = args.load * runs[0].jobs_per_s
        n = max(20, int(rate * args.seconds))
        arrivals = make_prefix_jobs(n, mix, seed=args.seed + 1, clients=n // 2000 + 1)
        for name in ("shared", "lanes", "ideal"):
            runs.append(run_contestant(server.url, name, "open-loop", [_copy(j) for j in arrivals], rate, args))
            print(json.dumps(asdict(runs[-1])), file=sys.stderr, flush=True)
        redis_version = server_version(server.url)
    by = {(r.contestant, r.phase): r for r in runs}
    got = ratios(by)
    met = {"hit_rate_to_ideal": (got["hit_rate_to_ideal"] or 0) >= TARGETS["hit_rate_to_ideal_at_least"],
           "prefill_to_shared": got["prefill_to_shared"] <= TARGETS["prefill_to_shared_at_most"],
           "p99_wait_to_shared": (got["p99_wait_to_shared"] or 0) <= TARGETS["p99_wait_to_shared_at_most"],
           "saturation_to_shared": (got["saturation_to_shared"] or 0) >= TARGETS["saturation_to_shared_at_least"]}
    result = {"workload": "W-PREFIX", "ratios": got, "met": met, "targets": TARGETS,
              "answered_once": all(r.answered_once for r in runs), "runs": [asdict(r) for r in runs],
              "config": {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)},
              "redis_version": redis_version, "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if result["answered_once"] else 1


def _copy(job: Job) -> Job:
    return Job(v=job.v, job_id=job.job_id, client_id=job.client_id, enqueued_at=0.0,
               prompt_token_ids=job.prompt_token_ids, sampling=job.sampling)
