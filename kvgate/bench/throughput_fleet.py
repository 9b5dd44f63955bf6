"""The throughput fleet of `kvgate bench fleet` (W-FLEET's jobs/s run, its cluster run in fleet_cluster.py, and
W-FAIR's cost run): a backlog of one-token jobs enqueued where the SDK would put them, drained by forked processes of
simulated workers (the GIL would cap threads) until every stream is read and acknowledged."""
from __future__ import annotations

import multiprocessing as mp
import time

from kvgate.producer.keys import Keys


def _throughput_child(url: str, namespace: str, first: int, count: int, ready, stop) -> None:
    from kvgate.bench import fleet_sim

    specs = [fleet_sim.WorkerSpec(f"tp-{first + i}", 8192, 256) for i in range(count)]
    fleet = fleet_sim.start_fleet(url, namespace, specs, "capacity", step_overhead_s=0.0005, per_token_s=0.0)
    ready.set()
    stop.wait()
    fleet.stop()


def backlog(n: int, seed: int) -> tuple[list, int]:
    """A throughput run's `n` jobs (one output token each) and how many reply clients they use."""
    from kvgate.bench import fleet_sim

    mix = fleet_sim.JobMix(prompt_tokens=(4, 16), max_tokens=(1, 1))
    clients = n // 2000 + 1  # reply streams are capped at 10k entries
    return fleet_sim.make_jobs(n, mix, seed=seed, clients=clients), clients


def drain_backlog(url: str, client, keys: Keys, jobs: list, procs: int, timeout: float = 300) -> None:
    """Enqueue `jobs` where the SDK would (each in its shard), then drain them with `procs` processes of 4 workers
    until every stream they went into is read and acknowledged."""
    from kvgate.bench import fleet_sim
    from kvgate.producer.keys import DEFAULT_MODEL
    from kvgate.producer.submission import stream_for

    fleet_sim.enqueue(client, keys, jobs, rate=None, batch=1000)
    streams = sorted({stream_for(job, job.model or DEFAULT_MODEL, keys, 0) for job in jobs})
    drain_in_processes(client, streams, procs, _throughput_child, lambda p: (url, keys.ns, p * 4, 4), timeout,
                       lambda: f"{len(jobs)} jobs not drained within {timeout:g}s: "
                               f"{fleet_sim.count_results(client, keys, jobs)} answered")


def drain_in_processes(client, streams: list[str], procs: int, target, args_of, timeout: float, failure) -> None:
    """Start `procs` forked `target(*args_of(p), ready, stop)` children, wait until each is ready, then until every
    stream in `streams` is read and acknowledged (TimeoutError with `failure()` past `timeout` s); stop them."""
    from kvgate.bench import fleet_sim

    ctx = mp.get_context("fork")
    stop, readies, children = ctx.Event(), [], []
    for p in range(procs):
        ready = ctx.Event()
        children.append(ctx.Process(target=target, args=(*args_of(p), ready, stop), daemon=True))
        readies.append(ready)
    for child in children:
        child.start()
    try:
        for ready in readies:
            ready.wait(60)
        deadline = time.monotonic() + timeout
        while not fleet_sim.drained(client, streams):
            if time.monotonic() > deadline:
                raise TimeoutError(failure())
            time.sleep(0.1)
    finally:
        stop.set()
        for child in children:
            child.join(30)


def drain_stats(n: int, finals: dict) -> dict:
    """Jobs/s from the first admission to the last finish, and whether each of `n` jobs got exactly one final."""
    firsts = [f[0] for f in finals.values()]
    started = min(f.timings.admitted for f in firsts if f.timings.admitted)
    span = max(f.timings.finished for f in firsts) - started
    return {"jobs_per_s": round(n / span, 1), "answered_once": len(finals) == n and all(len(f) == 1 for f in finals.values())}
