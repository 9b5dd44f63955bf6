"""`kvgate bench lora --fleet`: W-LORA's fleet half (issue 42). A simulated fleet of `--workers` workers with
`--slots` adapter slots each (the production engine over a cost-model runner; an adapter's first read from disk
into a worker's host memory costs `--lora-read-ms` on the worker's reading thread, a copy from host memory into a slot
`--lora-load-ms` inside the step) on one real Redis, in threads as W-FLEET's and W-PREFIX's; `--adapters`
adapters of popularity Zipf(`--zipf`). Three arms see the same jobs:
- aware: today's design, each adapter's jobs on its own streams, read by a worker only while the adapter has room in
  its slots (worker/adapters.py), or once they waited `--lora-aging-ms`;
- blind: every job on the base model's one shared stream, the job naming its adapter as its model; any worker takes
  any job and loads its adapter on demand into its least recently used idle slot (the same workers: they serve a job
  on their base's stream with the adapter its `model` names);
- base: the same jobs without adapters, on a fleet without adapter slots.
Each arm's fleet starts and serves (every worker sent its first heartbeat: its groups made, the registry read; for
aware and blind 603 streams a worker, about a second of the run's 20 in one process on two cores, charged to the
aware arm alone when the jobs came at once) before its first job; each runs twice: a backlog drained as fast as it
can (`saturation`: jobs/s from the first enqueue to the last answer; adapters are read from disk on first use, host
memory starts empty), then an open-loop arrival stream at `--load` of the base arm's saturation jobs/s (`open-loop`). Targets:
adapter loads <= 0.5x the blind arm's, jobs/s at saturation >= 0.9x the base arm's, and in the open loop the p99
queue wait (enqueue to admission into an engine) of the coldest decile of adapters <= 3x the hottest decile's.
Every job must be answered exactly once, or the run fails."""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

ARMS = ("aware", "blind", "base")
PHASES = ("saturation", "open-loop")
BASE = "sim-base"  # the served model's name; the adapters are registered as its
DECILES = 10
TARGETS = {"loads_to_blind_at_most": 0.5, "jobs_per_s_to_base_at_least": 0.9, "cold_to_hot_p99_wait_at_most": 3.0}


@dataclass(slots=True)
class LoraMix:
    adapters: int = 200
    zipf: float = 1.1
    prompt_tokens: tuple[int, int] = (32, 128)
    max_tokens: tuple[int, int] = (8, 24)

    def names(self) -> list[str]:
        """The adapters, hottest first: adapter-000 is drawn most often."""
        return [f"adapter-{k:03d}" for k in range(self.adapters)]

    def decile_of(self) -> dict[str, int]:
        """Each adapter's popularity decile: 0 the hottest tenth of the adapters, DECILES - 1 the coldest."""
        return {name: k * DECILES // self.adapters for k, name in enumerate(self.names())}


def make_lora_jobs(n: int, mix: LoraMix, *, seed: int, clients: int) -> list:
    """W-FLEET's jobs of `mix`'s lengths, each naming an adapter drawn by Zipf popularity as its model."""
    from kvgate.bench.fleet_sim import JobMix, make_jobs

    jobs = make_jobs(n, JobMix(mix.prompt_tokens, mix.max_tokens), seed=seed, clients=clients)
    weights = [1 / (k + 1) ** mix.zipf for k in range(mix.adapters)]
    for job, name in zip(jobs, random.Random(seed + 1).choices(mix.names(), weights, k=n)):
        job.model = name
    return jobs


def jobs_of_arm(jobs: list, arm: str) -> list:
    """Fresh copies of the run's jobs for one arm (enqueue stamps them); the base arm's name no adapter."""
    return [msgspec.structs.replace(j, enqueued_at=0.0, model=None if arm == "base" else j.model) for j in jobs]


@dataclass(slots=True)
class Decile:
    decile: int  # 0: the hottest tenth of the adapters
    jobs: int
    p50_wait_s: float
    p99_wait_s: float


@dataclass(slots=True)
class ArmOutcome:
    arm: str
    phase: str
    jobs: int
    rate: float | None
    jobs_per_s: float
    loads: int
    evictions: int
    p50_wait_s: float
    p99_wait_s: float
    answered_once: bool
    deciles: list[Decile] = field(default_factory=list)
    fleet_start_s: float = 0.0  # from the workers' start to the last one's first heartbeat: before the first job
    redis_cpu_s: float = 0.0  # Redis CPU over the arm's run: adapter-aware reads look at more streams

    def cold_to_hot(self) -> float | None:
        """The coldest decile's p99 queue wait over the hottest's."""
        hot, cold = self.deciles[0].p99_wait_s, self.deciles[-1].p99_wait_s
        return round(cold / hot, 3) if hot else None


def deciles(waits: dict[str, float], jobs: list, mix: LoraMix) -> list[Decile]:
    """Queue waits by the popularity decile of each job's adapter (the base arm's too: by the adapter its job had)."""
    from kvgate.bench.fleet import percentile

    decile_of, by = mix.decile_of(), [[] for _ in range(DECILES)]
    for job in jobs:
        if job.job_id in waits:
            by[decile_of[job.model]].append(waits[job.job_id])
    return [Decile(d, len(w), round(percentile(w, 0.5), 4), round(percentile(w, 0.99), 4)) for d, w in enumerate(by)]


def register_adapters(url: str, namespace: str, mix: LoraMix, folder: Path) -> None:
    """Every adapter of `mix` registered as BASE's, each a PEFT folder with the config the simulated engine checks."""
    from kvgate.producer import Client

    with Client(url, namespace) as client:
        for name in mix.names():
            (folder / name).mkdir(exist_ok=True)
            (folder / name / "adapter_config.json").write_text("{}")
            client.add_lora(name, str(folder / name), BASE)


def run_arm(url: str, arm: str, phase: str, jobs: list, rate: float | None, args, folder: Path) -> ArmOutcome:
    """One arm's fleet on a fresh namespace: `jobs` (the run's, as they name their adapters) enqueued as a backlog
    (rate None) or paced at `rate` jobs/s, until every one is answered."""
    import redis

    from kvgate.bench import fleet_sim
    from kvgate.bench.fleet import _wait_answered, percentile
    from kvgate.producer.keys import Keys

    mix, slots = mix_of(args), 0 if arm == "base" else args.slots
    keys, client = Keys(f"wlora-{arm}-{phase}-{time.time_ns()}"), redis.Redis.from_url(url)
    if slots:
        register_adapters(url, keys.ns, mix, folder)
    clients = len(jobs) // 2000 + 1
    specs = [fleet_sim.WorkerSpec(f"lora-{i}", args.num_blocks, args.max_num_seqs, slots) for i in range(args.workers)]
    fleet = fleet_sim.start_fleet(url, keys.ns, specs, "capacity", step_overhead_s=args.step_ms / 1000 / args.speed,
                                  per_token_s=args.per_token_ms / 1000 / args.speed, seed=args.seed,
                                  lora_load_s=args.lora_load_ms / 1000 / args.speed,
                                  lora_read_s=args.lora_read_ms / 1000 / args.speed, served_model_name=BASE,
                                  lora_aging_ms=args.lora_aging_ms)
    mine = jobs_of_arm(jobs, arm)
    try:
        start_s = fleet.wait_serving(client, keys)
        fleet_sim.enqueue(client, keys, mine, rate=rate, batch=max(1, int((rate or 1000) / 50)),
                          stream_model=BASE if arm == "blind" else None)
        _wait_answered(client, keys, mine, timeout=120 + len(jobs) / 5)
    finally:
        fleet.stop()
    finals = fleet_sim.collect_finals(client, keys, clients)
    once = len(finals) == len(jobs) and all(len(f) == 1 and f[0].status == "done" for f in finals.values())
    firsts = [f[0] for f in finals.values()]
    waits = {f.job_id: f.timings.admitted - f.timings.queued for f in firsts if f.timings.admitted}
    span = max(f.timings.finished for f in firsts) - min(f.timings.queued for f in firsts)
    slots_of = [w.engine.loras for w in fleet.workers]
    return ArmOutcome(arm, phase, len(jobs), round(rate, 2) if rate else None, round(len(firsts) / span, 2),
                      sum(s.loads for s in slots_of), sum(s.evictions for s in slots_of),
                      round(percentile(list(waits.values()), 0.5), 4), round(percentile(list(waits.values()), 0.99), 4),
                      once, deciles(waits, jobs, mix), round(start_s, 2))


def mix_of(args) -> LoraMix:
    return LoraMix(args.adapters, args.zipf, (min(32, args.max_prompt), args.max_prompt),
                   (min(8, args.max_output), args.max_output))


def ratios(by: dict[tuple[str, str], ArmOutcome]) -> dict:
    """Each target's figure: loads over the blind arm's (both phases), saturation jobs/s over the base arm's, and the
    aware arm's coldest-over-hottest p99 queue wait in the open loop (and at saturation, not a target)."""
    def over(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    return {"loads_to_blind": {p: over(by[("aware", p)].loads, by[("blind", p)].loads) for p in PHASES},
            "jobs_per_s_to_base": over(by[("aware", "saturation")].jobs_per_s, by[("base", "saturation")].jobs_per_s),
            "blind_jobs_per_s_to_base": over(by[("blind", "saturation")].jobs_per_s,
                                             by[("base", "saturation")].jobs_per_s),
            "cold_to_hot_p99_wait": {p: by[("aware", p)].cold_to_hot() for p in PHASES}}


def verdicts(got: dict) -> dict[str, str]:
    """PASS or FAIL per target (a figure that could not be taken, a zero denominator, is a FAIL)."""
    def judge(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    loads = got["loads_to_blind"].values()
    cold = got["cold_to_hot_p99_wait"]["open-loop"]
    return {"loads_to_blind": judge(all(r is not None and r <= TARGETS["loads_to_blind_at_most"] for r in loads)),
            "jobs_per_s_to_base": judge((got["jobs_per_s_to_base"] or 0) >= TARGETS["jobs_per_s_to_base_at_least"]),
            "cold_to_hot_p99_wait": judge(cold is not None and cold <= TARGETS["cold_to_hot_p99_wait_at_most"])}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The fleet half's flags beside the engine half's: `--adapters` (default 200 here), `--max-num-seqs` (running
    sequences per worker, 16), `--max-prompt` (128) and `--max-output` (24), `--seed` and `--json` are shared."""
    from kvgate.bench.fleet import add_cost_model_arguments

    group = parser.add_argument_group("--fleet (W-LORA's fleet half)")
    group.add_argument("--fleet", action="store_true", help="run the fleet half instead of the engine half")
    group.add_argument("--workers", type=int, default=16, help="simulated workers (default 16)")
    group.add_argument("--slots", type=int, default=8, help="adapter slots per worker (default 8)")
    group.add_argument("--zipf", type=float, default=1.1, help="the adapters' popularity exponent (default 1.1)")
    group.add_argument("--jobs", type=int, default=2000, help="the saturation backlog's jobs (default 2000)")
    group.add_argument("--seconds", type=float, default=8.0, help="open-loop arrival window (default 8)")
    group.add_argument("--load", type=float, default=0.7,
                       help="open-loop rate as a fraction of the base arm's saturation jobs/s (default 0.7)")
    group.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker (default 1024)")
    group.add_argument("--lora-read-ms", type=float, default=50.0,
                       help="what reading an adapter from disk into a worker's host memory costs, once per adapter "
                            "and worker, on the worker's reading thread (default 50 ms)")
    group.add_argument("--lora-load-ms", type=float, default=2.0,
                       help="what copying an adapter from host memory into a device slot costs, inside the step "
                            "(default 2 ms: a rank-16 adapter of a 0.5B model is about 15 MB; before the reads left "
                            "the loop, the bench charged 50 ms here for every load, reloads included)")
    group.add_argument("--lora-aging-ms", type=int, default=5000, help="the workers' --lora-aging-ms (default 5000)")
    group.add_argument("--speed", type=float, default=0.2,
                       help="divide the cost model's times by this (default 0.2: 100 ms steps, slow enough that 16 "
                            "workers in one process on 2 shared cores keep up with the cost model)")
    add_cost_model_arguments(group)


def run(args: argparse.Namespace) -> int:
    from kvgate.bench.fleet_sim import RedisProcess
    from kvgate.bench.queue import server_version

    args.adapters, args.max_num_seqs = args.adapters or 200, args.max_num_seqs or 16
    args.max_prompt, args.max_output = args.max_prompt or 128, args.max_output or 24
    mix, runs = mix_of(args), []
    started = time.monotonic()
    with RedisProcess() as server, tempfile.TemporaryDirectory(prefix="kvgate-wlora-") as tmp:
        backlog = make_lora_jobs(args.jobs, mix, seed=args.seed, clients=args.jobs // 2000 + 1)
        rate = None
        for phase in PHASES:
            if phase == "open-loop":
                rate = args.load * next(r.jobs_per_s for r in runs if r.arm == "base")
                n = max(20, int(rate * args.seconds))
                backlog = make_lora_jobs(n, mix, seed=args.seed + 2, clients=n // 2000 + 1)
            for arm in ("base", "aware", "blind"):  # base first: the open loop's rate is a share of its jobs/s
                cpu = server.cpu_seconds()
                runs.append(run_arm(server.url, arm, phase, backlog, rate, args, Path(tmp)))
                runs[-1].redis_cpu_s = round(server.cpu_seconds() - cpu, 2)
                print(summary_line(runs[-1]), file=sys.stderr, flush=True)
        redis_version = server_version(server.url)
    by = {(r.arm, r.phase): r for r in runs}
    got = ratios(by)
    result = {"workload": "W-LORA fleet", "ratios": got, "verdicts": verdicts(got), "targets": TARGETS,
              "answered_once": all(r.answered_once for r in runs), "runs": [asdict(r) for r in runs],
              "config": {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)
                         and not isinstance(v, Path)},
              "redis_version": redis_version, "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
              "wall_s": round(time.monotonic() - started, 1)}
    print(json.dumps({k: result[k] for k in ("ratios", "verdicts", "answered_once", "wall_s")}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if result["answered_once"] else 1


def summary_line(r: ArmOutcome) -> str:
    return (f"{r.phase} {r.arm}: {r.jobs} jobs, {r.jobs_per_s} jobs/s, {r.loads} loads, Redis CPU {r.redis_cpu_s} s, "
            f"p99 wait {r.p99_wait_s} s, "
            f"hottest decile p99 {r.deciles[0].p99_wait_s} s, coldest {r.deciles[-1].p99_wait_s} s, "
            f"answered once {r.answered_once}")
