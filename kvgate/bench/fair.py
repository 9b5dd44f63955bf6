"""W-FAIR: fair share across tenants on the simulated fleet of W-FLEET (16 mixed workers, one real Redis).

Two contestants in the same run, each on its own namespaces and fleets: today's FIFO per priority, and the fair
reader (`{ns}:fair` set: each tenant's stream, weighted virtual token counters; worker/fair.py). Phases, in turn:
- A alone: A's backlog with nobody else, on a fleet of its own; jobs/s from its first admission to its last finish
  (the fair reader's over FIFO's: work-conserving, target >= 0.95x), and the fleet's capacity the next phases' rate
  is 20% of. `--alone-rounds` passes per contestant, taking turns (fifo, fair, fair, fifo), before the phases below:
  the machine's load drifts over a run of half an hour, and a contestant measured only at its start or only at its
  end would carry that drift in the ratio.
- alone: tenants B and C each send `--bc-jobs` open-loop at 20% of the fleet's capacity; their queue wait.
- flood: tenant A enqueues `--a-jobs` at once, then, once the fleet has answered one of A's jobs, B and C as above;
  B's and C's p99 queue wait over their wait alone (target <= 2x). Beside the flood means beside its steady state:
  an idle fleet's first fill of a flood runs prefill steps of up to max_num_batched_tokens (0.43 s in the cost
  model), and a job landing then waits the step out whoever's flood it is (fair share or not: no job joins a step
  in progress). At the issue's counts the enqueue itself outlasts the first fill; at `--scale 0.1` B's and C's
  first jobs landed inside it (0.4-0.5 s waits, the p99 of 150 jobs). `flood_bc_start_s` says when they started.
- shares: A, B and C each enqueue a backlog at once; tokens served per tenant over every `--window-s` window while
  all three are backlogged, at equal weights (target: each within +-15% of their mean) and at 2:1:1 (A's share
  within +-15% of half). On a cluster also, per tenant, how long its backlog lasted in some shards after it ran dry
  in the first (`shard_tail_s`): its last jobs in a few shards get only those shards' turns of the reads.
Every job must get exactly one final event, or the run fails. `--scale` shrinks every job count for a quick run.

Variants, one a command: `--cluster-primaries N` runs everything on a Redis Cluster of N primaries (the namespace in
two shards a primary, as kvgate splits it) instead of one Redis; `--affinity on` starts every worker with prefix-affinity
lanes (W-PREFIX's setting). With fair share on, producers send jobs to tenants' streams, never into lanes, so the fair
contestant's workers read lanes that stay empty beside the tenants' streams; FIFO's producers route into the lanes.
The results' `variant` says which ran.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvgate.producer.keys import DEFAULT_MODEL, Keys
from kvgate.producer.protocol import FIELD
from kvgate.producer.spread import TenantSpread

CONTESTANTS = ("fifo", "fair", "fair-wait", "fair-hashed")
TARGET_WAIT_RATIO = 2.0
TARGET_ALONE_RATIO = 0.95
TARGET_SHARE_TOLERANCE = 0.15
CLIENT_JOBS = 2000  # jobs per reply client: reply streams keep 10,000 entries


def jobs_of(tenant: str, phase: str, n: int, seed: int) -> list:
    from kvgate.bench import fleet_sim

    jobs = fleet_sim.make_jobs(n, fleet_sim.JobMix(), seed=seed, clients=1)
    for i, job in enumerate(jobs):
        job.job_id, job.tenant, job.client_id = f"{phase}-{tenant}-{i}", tenant, f"{phase}-{tenant}-{i // CLIENT_JOBS}"
    return jobs


@dataclass(slots=True)
class Target:
    """Where a run's contestants live: one Redis, or a Redis Cluster of `primaries` primaries (`url` names it to
    every client and worker); `cpu_seconds()` is the Redis CPU used so far, summed over the primaries."""

    url: str
    primaries: int  # 0: one Redis
    cpu_seconds: Callable[[], float]
    version: str


@contextlib.contextmanager
def redis_target(primaries: int):
    """One throwaway Redis without persistence, or a cluster of `primaries` primaries run the same way."""
    from kvgate.bench.fleet_sim import RedisProcess
    from kvgate.bench.queue import server_version

    if not primaries:
        with RedisProcess() as server:
            yield Target(server.url, 0, server.cpu_seconds, server_version(server.url))
        return
    from kvgate.bench.fleet_cluster import NO_PERSISTENCE, cluster_unavailable, cpu_seconds
    from kvgate.redis_cluster import ClusterGroup

    if why := cluster_unavailable():
        raise SystemExit(f"--cluster-primaries {primaries}: {why}; run with --cluster-primaries 0 for one Redis")
    with tempfile.TemporaryDirectory(prefix="kvgate-wfair-cluster-") as tmp:
        group = ClusterGroup(Path(tmp), primaries=primaries, replicas=0, extra_args=NO_PERSISTENCE).start()
        try:
            nodes = group.primary_nodes()
            yield Target(group.url, primaries, lambda: sum(cpu_seconds(n) for n in nodes), nodes[0].version())
        finally:
            group.stop()


def namespace(url: str, name: str):
    """A client for `url` and a fresh namespace's keys on it (on a cluster, split into its shards)."""
    from kvgate.producer.redis_url import connect, keys_for

    client = connect(url)
    return client, keys_for(url, client, f"{name}-{time.time_ns()}")


def spread_of(keys: Keys, fair: bool) -> TenantSpread | None:
    """How the SDK deals a fair-share producer's jobs out over a cluster's shards; None on one Redis or not fair."""
    return TenantSpread(len(keys.parts)) if fair and len(keys.parts) > 1 else None


def worker_settings(args, contestant: str) -> dict:
    """Further WorkerSettings of every worker of the variant (affinity lanes on, as W-PREFIX's lanes contestant) and
    of the contestant (fair-wait: no room made for a job that waited)."""
    settings = {"affinity": "on", "affinity_lanes": args.lanes} if args.affinity == "on" else {}
    return settings | ({"fair_preempt_ms": 0} if contestant == "fair-wait" else {})


def check_contestants(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(CONTESTANTS))
    if unknown or not names:
        raise SystemExit(f"--contestants {text!r}: {'unknown ' + ', '.join(unknown) if unknown else 'none given'}; "
                         f"choose from {', '.join(CONTESTANTS)}, comma-separated")
    return names


def finals_of(client, keys: Keys, jobs: list) -> dict[str, list]:
    """Every final event of `jobs`, from their clients' reply streams in every shard."""
    from kvgate.producer.protocol import decode_event

    finals: dict[str, list] = {}
    for reply in sorted({r for job in jobs for r in keys.replies(job.client_id)}):
        for _, fields in client.xrange(reply):
            event = decode_event(fields[FIELD.encode()])
            finals.setdefault(event.job_id, []).append(event)
    return finals


def wait_answered(client, keys: Keys, jobs: list, timeout: float, what: str, every_s: float = 30.0) -> None:
    """Until every one of `jobs` is answered; a line on stderr every `every_s` says how far `what` has come (a
    phase at the issue's counts runs for minutes)."""
    from kvgate.bench.fleet_sim import count_results

    start = time.monotonic()
    deadline, told = start + timeout, start
    while (done := count_results(client, keys, jobs)) < len(jobs):
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"{what}: only {done} of {len(jobs)} jobs answered in {timeout:.0f} s")
        if now - told >= every_s:
            told = now
            print(f"{what}: {done} of {len(jobs)} jobs answered after {now - start:.0f} s", file=sys.stderr,
                  flush=True)
        time.sleep(0.2)


def wait_first_answer(client, keys: Keys, jobs: list, timeout: float, what: str) -> None:
    """Until one of `jobs` is answered: an entry in one of their clients' reply streams (an XLEN per client and
    shard a poll, whatever the jobs)."""
    replies = sorted({r for job in jobs for r in keys.replies(job.client_id)})
    deadline = time.monotonic() + timeout
    while True:
        pipe = client.pipeline(transaction=False)
        for reply in replies:
            pipe.xlen(reply)
        if any(pipe.execute()):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: none of {len(jobs)} jobs answered in {timeout:.0f} s")
        time.sleep(0.05)


def p99_wait(finals: dict, jobs: list) -> float:
    from kvgate.bench.fleet import percentile

    waits = [f[0].timings.admitted - f[0].timings.queued for j in jobs if (f := finals.get(j.job_id))
             and f[0].timings.admitted]
    return round(percentile(waits, 0.99), 3)


def tokens(final) -> int:
    return final.usage.prompt_tokens + final.usage.completion_tokens


def answered_once(finals: dict, n: int) -> bool:
    """Every one of the n jobs got exactly one final event."""
    return len(finals) == n and all(len(f) == 1 for f in finals.values())


def jobs_per_s(finals: dict) -> float:
    """Jobs over the span from the first admission to the last finish (by each job's first final event)."""
    firsts = [f[0] for f in finals.values()]
    span = max(f.timings.finished for f in firsts) - min(f.timings.admitted for f in firsts if f.timings.admitted)
    return round(len(firsts) / span, 1)


def window_shares(finals: dict, by_tenant: dict[str, list], window_s: float) -> list[dict[str, float]]:
    """Each tenant's share of the tokens of the jobs the fleet admitted in every full window while all of them were
    backlogged: from the last tenant's first job queued (until then the others share the fleet, as they should) up
    to the first tenant's last admission. By admission, the scheduler's decision: a job's finish trails it by its
    run time, seconds here, which would smear windows of a few seconds."""
    done = {t: sorted((f[0].timings.admitted, tokens(f[0])) for j in jobs if (f := finals.get(j.job_id))
                      and f[0].timings.admitted) for t, jobs in by_tenant.items()}
    start = max(min(f[0].timings.queued for j in jobs if (f := finals.get(j.job_id))) for jobs in by_tenant.values())
    end = min(d[-1][0] for d in done.values())
    shares = []
    t = start
    while t + window_s <= end:
        served = {tenant: sum(n for at, n in d if t <= at < t + window_s) for tenant, d in done.items()}
        total = sum(served.values())
        if total:
            shares.append({tenant: round(n / total, 4) for tenant, n in served.items()})
        t += window_s
    return shares


def shard_tails(finals: dict, by_tenant: dict[str, list], keys: Keys) -> dict[str, float]:
    """On a Redis Cluster, per tenant: seconds from its backlog's last admission in the shard where it ran out first
    to its last admission anywhere (each job sits in the shard its id hashes to). Long, its last jobs sat in a few
    shards, whose turns of the fleet's reads can be less than its share."""
    tails = {}
    for tenant, jobs in by_tenant.items():
        last: dict[int, float] = {}
        for j in jobs:
            if (f := finals.get(j.job_id)) and f[0].timings.admitted:
                shard = keys.shard_of(j.job_id)
                last[shard] = max(last.get(shard, 0.0), f[0].timings.admitted)
        tails[tenant] = round(max(last.values()) - min(last.values()), 2) if last else 0.0
    return tails


@dataclass(slots=True)
class Arena:
    """One contestant's fleet on a fresh namespace, and where its producers send jobs."""

    client: object
    keys: Keys
    fleet: object
    route: dict  # fleet_sim.enqueue's fair=, lanes= and spread=
    lanes: int  # the ring's lanes (affinity on), whether the contestant's producers route into them or not
    name: str  # the contestant's


@contextlib.contextmanager
def arena(url: str, name: str, args):
    """A fresh namespace (fair share set unless `name` is fifo) and a fleet of the contestant's workers on it;
    lanes on: every worker in the ring before the first job. FIFO's producers route into the lanes, the fair
    contestant's send to tenants' streams whatever the lanes (the SDK's rule); on a cluster, dealt out over the
    shards as the SDK deals them (producer/spread.py), but fair-hashed's each in the shard its job id hashes to."""
    from kvgate.bench import fleet_sim
    from kvgate.bench.prefix import wait_for_ring

    fair = name != "fifo"
    client, keys = namespace(url, f"wfair-{name}")
    spread = spread_of(keys, fair and name != "fair-hashed")
    if fair:
        client.set(keys.fair(), 1)
    specs = fleet_sim.mixed_fleet(args.workers)
    fleet = fleet_sim.start_fleet(url, keys.ns, specs, "capacity", step_overhead_s=args.step_ms / 1000,
                                  per_token_s=args.per_token_ms / 1000, seed=args.seed,
                                  **worker_settings(args, name))
    try:
        lanes = wait_for_ring(client, keys, len(specs)) if args.affinity == "on" else 0
        yield Arena(client, keys, fleet, dict(fair=fair, lanes=0 if fair else lanes, spread=spread), lanes, name)
    finally:
        fleet.stop()


def a_jobs(args) -> int:
    return max(50, int(args.a_jobs * args.scale))


def a_alone(url: str, name: str, args) -> dict:
    """A's backlog with nobody else, on a fleet of its own: jobs/s from its first admission to its last finish, and
    whether every job was answered once. The same jobs in every pass."""
    from kvgate.bench import fleet_sim

    with arena(url, name, args) as ar:
        a = jobs_of("a", "solo", a_jobs(args), args.seed + 3)
        fleet_sim.enqueue(ar.client, ar.keys, a, rate=None, batch=500, **ar.route)
        wait_answered(ar.client, ar.keys, a, 900, f"{name}: A alone")
        finals = finals_of(ar.client, ar.keys, a)
    out = {"contestant": name, "jobs_per_s": jobs_per_s(finals), "answered_once": answered_once(finals, len(a))}
    print(json.dumps({"a_alone": out}), file=sys.stderr, flush=True)
    return out


def alone_order(names: list[str], rounds: int) -> list[str]:
    """The A-alone passes in turn, each round the reverse of the one before (fifo, fair, fair, fifo for two rounds),
    so a machine whose load drifts during the run weighs on every contestant alike."""
    return [name for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


def run_contestant(url: str, name: str, args, alone: list[dict]) -> dict:
    """One contestant's phases after its A-alone passes (`alone`): `fifo`, `fair`, or `fair-wait` (the fair reader
    without making room for a job that waited: fair_preempt_ms 0)."""
    from kvgate.bench import fleet_sim
    from kvgate.bench.fleet import fleet_capacity

    capacity = fleet_capacity(fleet_sim.mixed_fleet(args.workers), fleet_sim.JobMix(), args.step_ms / 1000,
                              args.per_token_ms / 1000)
    passes = [p["jobs_per_s"] for p in alone]
    out: dict = {"contestant": name, "capacity_jobs_per_s": round(capacity, 1),
                 "a_alone_passes_jobs_per_s": passes, "a_alone_jobs_per_s": round(sum(passes) / len(passes), 1)}
    # 20% of what this fleet does on this machine (its A-alone passes), or of the cost model's estimate
    rate = out["bc_rate_jobs_per_s"] = round(0.2 * (out["a_alone_jobs_per_s"] if args.rate_from == "measured"
                                                     else capacity), 1)
    with arena(url, name, args) as ar:
        out["lanes"], out["shards"] = ar.lanes, len(ar.keys.parts)
        phases, jobs = run_phases(url, ar, args, rate)
        out.update(phases, stepped_aside=sum(w.engine.stats.stepped_aside for w in ar.fleet.workers))  # made room
    finals = finals_of(ar.client, ar.keys, jobs)
    out["answered_once"] = answered_once(finals, len(jobs)) and all(p["answered_once"] for p in alone)
    print(json.dumps({k: v for k, v in out.items() if k not in ("equal", "weighted_2_1_1")}), file=sys.stderr,
          flush=True)
    return out


def run_phases(url: str, ar: Arena, args, rate: float) -> tuple[dict, list]:
    """The phases with B and C (alone, beside A's flood, and the share backlogs), B and C at `rate` jobs/s each:
    their measures, and every job they enqueued."""
    from kvgate.bench import fleet_sim
    from kvgate.producer.redis_url import connect

    client, keys, route = ar.client, ar.keys, ar.route
    n_bc, n_share = max(50, int(args.bc_jobs * args.scale)), max(100, int(args.share_jobs * args.scale))
    out: dict = {}
    every: list = []

    def open_loop(phase: str) -> tuple[list, list]:
        b, c = jobs_of("b", phase, n_bc, args.seed + 1), jobs_of("c", phase, n_bc, args.seed + 2)
        threads = [threading.Thread(target=fleet_sim.enqueue, args=(connect(url), keys, js),
                                    kwargs=dict(rate=rate, batch=1, **route)) for js in (b, c)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return b, c

    b, c = open_loop("alone")
    wait_answered(client, keys, b + c, 300, f"{ar.name}: B and C alone")
    finals = finals_of(client, keys, b + c)
    out["alone_p99_wait_s"] = {"b": p99_wait(finals, b), "c": p99_wait(finals, c)}
    every += [b, c]

    a = jobs_of("a", "flood", a_jobs(args), args.seed)
    flood_at = time.monotonic()
    fleet_sim.enqueue(client, keys, a, rate=None, batch=500, **route)
    wait_first_answer(client, keys, a, 300, f"{ar.name}: A's flood's first answer")
    out["flood_bc_start_s"] = round(time.monotonic() - flood_at, 2)
    b, c = open_loop("flood")
    wait_answered(client, keys, b + c, 600, f"{ar.name}: B and C beside A's flood")
    finals = finals_of(client, keys, b + c)
    out["flood_p99_wait_s"] = {"b": p99_wait(finals, b), "c": p99_wait(finals, c)}
    out["flood_wait_ratio"] = {t: round(out["flood_p99_wait_s"][t] / max(out["alone_p99_wait_s"][t], 1e-3), 2)
                               for t in ("b", "c")}
    wait_answered(client, keys, a, 900, f"{ar.name}: A's flood")
    every += [a, b, c]

    for label, weights in (("equal", {}), ("weighted_2_1_1", {"a": 2})):
        if weights:
            client.hset(keys.tenants(), mapping=weights)
            time.sleep(2.5)  # workers read weights with their heartbeat
        by = {t: jobs_of(t, label, n_share * (2 if t == "a" and weights else 1), args.seed + 4 + i)
              for i, t in enumerate("abc")}
        for t in "abc":  # one tenant after another, as three producers' bulk submits land
            fleet_sim.enqueue(client, keys, by[t], rate=None, batch=500, **route)
        all_jobs = [j for js in by.values() for j in js]
        wait_answered(client, keys, all_jobs, 900, f"{ar.name}: shares, {label}")
        finals = finals_of(client, keys, all_jobs)
        shares = window_shares(finals, by, args.window_s)
        if weights:
            worst = max((abs(s["a"] - 0.5) / 0.5 for s in shares), default=None)
        else:
            worst = max((abs(v * 3 - 1) for s in shares for v in s.values()), default=None)
        out[label] = {"windows": len(shares), "worst_deviation": round(worst, 3) if worst is not None else None,
                      "shares": shares}
        if len(keys.parts) > 1:
            out[label]["shard_tail_s"] = shard_tails(finals, by, keys)
        every += list(by.values())
    return out, [j for js in every for j in js]


def _drain_child(url: str, namespace: str, first: int, settings: dict, ready, stop) -> None:
    from kvgate.bench import fleet_sim

    specs = [fleet_sim.WorkerSpec(f"tp-{first + i}", 8192, 256) for i in range(4)]
    fleet = fleet_sim.start_fleet(url, namespace, specs, "capacity", step_overhead_s=0.0005, per_token_s=0.0,
                                  **settings)
    ready.set()
    stop.wait()
    fleet.stop()


def run_cost(target: Target, fair: bool, args) -> dict:
    """A backlog of one-token jobs of `--cost-tenants` tenants drained by `--procs` processes of 4 workers: jobs/s
    and Redis CPU per job (enqueue, reads, results, acks; on a cluster, of every primary), the queue path's cost with
    and without fair share. Lanes on: the drain waits for the ring first, and FIFO's jobs go into the lanes."""
    from kvgate.bench import fleet_sim
    from kvgate.bench.throughput_fleet import backlog, drain_in_processes
    from kvgate.producer.submission import stream_for

    client, keys = namespace(target.url, f"wfair-cost-{'fair' if fair else 'fifo'}")
    if fair:
        client.set(keys.fair(), 1)
    jobs, clients = backlog(max(1000, int(args.cost_jobs * args.scale)), args.seed)
    for i, job in enumerate(jobs):
        job.tenant = f"t{i % args.cost_tenants}"
    settings = worker_settings(args, "fair" if fair else "fifo")
    if settings:  # the namespace's lane count, set as its first worker with affinity on would (SET NX)
        client.set(keys.lanes(), args.lanes, nx=True)
    lanes = int(client.get(keys.lanes())) if settings and not fair else 0
    cpu0 = target.cpu_seconds()
    fleet_sim.enqueue(client, keys, jobs, rate=None, batch=1000, fair=fair, lanes=lanes, spread=spread_of(keys, fair))
    streams = sorted({Keys.tenant_jobs(fleet_sim.fair_band(keys, j), j.tenant) if fair
                      else stream_for(j, DEFAULT_MODEL, keys, lanes) for j in jobs})
    drain_in_processes(client, streams, args.procs, _drain_child, lambda p: (target.url, keys.ns, p * 4, settings),
                       600, lambda: f"{len(jobs)} jobs not drained within 600 s")
    redis_cpu = target.cpu_seconds() - cpu0
    finals = fleet_sim.collect_finals(client, keys, clients)
    out = {"contestant": "fair" if fair else "fifo", "jobs": len(jobs), "tenants": args.cost_tenants,
           "jobs_per_s": jobs_per_s(finals), "redis_cpu_s": round(redis_cpu, 2),
           "jobs_per_redis_cpu_s": round(len(jobs) / max(redis_cpu, 1e-9), 1),
           "answered_once": answered_once(finals, len(jobs))}
    print(json.dumps({"cost": out}), file=sys.stderr, flush=True)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvgate.bench.fleet import add_cost_model_arguments

    parser.add_argument("--cost-jobs", type=int, default=30000,
                        help="one-token jobs of the Redis cost run, per contestant (default 30000; 0 = skip)")
    parser.add_argument("--cost-tenants", type=int, default=3, help="tenants of the cost run (default 3)")
    parser.add_argument("--procs", type=int, default=2, help="worker processes of the cost run (4 workers each)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--workers", type=int, default=16, help="simulated workers (default 16, W-FLEET's mix)")
    parser.add_argument("--a-jobs", type=int, default=20000, help="tenant A's flood (default 20000)")
    parser.add_argument("--bc-jobs", type=int, default=300, help="jobs B and C each send open-loop (default 300)")
    parser.add_argument("--share-jobs", type=int, default=3000,
                        help="backlog per tenant in the share phases (default 3000; A's doubled at 2:1:1)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every job count (a quick run: 0.1)")
    parser.add_argument("--window-s", type=float, default=10.0, help="window of the share measure (default 10 s)")
    add_cost_model_arguments(parser)
    parser.add_argument("--rate-from", choices=("measured", "model"), default="measured",
                        help="B's and C's rate: 20%% of the fleet's jobs/s with A alone, measured first in the run "
                             "(default), or of the cost model's estimate (a loaded machine runs below it)")
    parser.add_argument("--contestants", default="fifo,fair",
                        help="comma-separated: fifo, fair, fair-wait (the fair reader that never makes room for a "
                             "job that waited: fair_preempt_ms 0), fair-hashed (on a cluster, each job in the shard "
                             "its id hashes to, as before the SDK dealt them out) (default fifo,fair)")
    parser.add_argument("--cluster-primaries", type=int, default=0,
                        help="run on a Redis Cluster of this many primaries, two shards each (default 0: one Redis)")
    parser.add_argument("--affinity", choices=("on", "off"), default="off",
                        help="workers with prefix-affinity lanes (default off); FIFO's jobs go into the lanes, "
                             "fair share's into tenants' streams")
    parser.add_argument("--lanes", type=int, default=32, help="lanes with --affinity on (default 32, as W-PREFIX)")
    parser.add_argument("--alone-rounds", type=int, default=2,
                        help="rounds of A-alone passes, each contestant once a round on a fleet of its own, every "
                             "round in the reverse order of the one before (default 2: fifo, fair, fair, fifo)")
    parser.add_argument("--seed", type=int, default=0)


def variant_of(args) -> dict:
    """Which W-FAIR ran: one Redis or a cluster (and of how many primaries), affinity lanes on or off."""
    return {"redis": f"cluster of {args.cluster_primaries} primaries" if args.cluster_primaries else "one Redis",
            "cluster_primaries": args.cluster_primaries, "affinity": args.affinity,
            "lanes": args.lanes if args.affinity == "on" else 0}


def run(args: argparse.Namespace) -> int:
    if args.alone_rounds < 1:
        raise SystemExit(f"--alone-rounds {args.alone_rounds}: give 1 or more (2: each contestant twice, ABBA)")
    if args.cluster_primaries < 0:
        raise SystemExit(f"--cluster-primaries {args.cluster_primaries}: give 0 (one Redis) or the primaries, e.g. 3")
    names = check_contestants(args.contestants)
    with redis_target(args.cluster_primaries) as target:
        cost = {name: run_cost(target, name != "fifo", args) for name in names if name in ("fifo", "fair")} \
            if args.cost_jobs else {}
        alone: dict[str, list[dict]] = {name: [] for name in names}
        for name in alone_order(names, args.alone_rounds):
            alone[name].append(a_alone(target.url, name, args))
        runs = {name: run_contestant(target.url, name, args, alone[name]) for name in names}
        redis_version = target.version
    fair, fifo = runs.get("fair"), runs.get("fifo")
    headline = {}
    if fair:
        headline = {"flood_wait_ratio": fair["flood_wait_ratio"],
                    "equal_worst_deviation": fair["equal"]["worst_deviation"],
                    "weighted_worst_deviation": fair["weighted_2_1_1"]["worst_deviation"]}
        if fifo:
            headline["a_alone_ratio_to_fifo"] = round(fair["a_alone_jobs_per_s"] / fifo["a_alone_jobs_per_s"], 3)
        if len(cost) == 2:
            headline["redis_cpu_per_job_ratio_to_fifo"] = round(
                cost["fifo"]["jobs_per_redis_cpu_s"] / cost["fair"]["jobs_per_redis_cpu_s"], 3)
    result = {"workload": "W-FAIR", "variant": variant_of(args), **headline, "answered_once": all(r["answered_once"] for r in
                                                                        [*runs.values(), *cost.values()]),
              "cost": cost, "runs": runs, "config": {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)},
              "redis_version": redis_version, "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
              "targets": {"flood_wait_ratio_at_most": TARGET_WAIT_RATIO, "a_alone_ratio_at_least": TARGET_ALONE_RATIO,
                          "share_deviation_at_most": TARGET_SHARE_TOLERANCE}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if result["answered_once"] else 1
