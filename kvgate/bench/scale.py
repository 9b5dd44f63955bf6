"""W-SCALE: a day of a simulated fleet under KEDA and the HPA (kvgate/bench/scale_policy.py), scaling on work
against today's lag-count triggers and against the best constant fleet.

Discrete events in simulated time (a day runs in seconds): job arrivals, job ends, workers ready after a cold start,
and one autoscaler tick per polling interval, which reads the gauges the exporter would publish (the waiting work
priced by producer/queue_work.py's own sampling, the rate served over the last minute) and sets the replica count.
A worker has `slots` jobs running at once, each served at an equal share of the worker's tokens/s (continuous
batching at a steady batch size); the fleet takes a waiting job, highest priority first and oldest first within
one, whenever a ready worker has a free slot, as KV-capacity admission does. A removed worker that is running jobs
drains them first; its minutes count from its pod's start (cold start included) to its end.

The trace: interactive jobs (priority high) all day at a rate that rises and falls once a day, and a batch of
`batch_lines` lines (priority low, one deadline `window_s` after they arrive) at a random time.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

from kvgate.bench.scale_policy import TODAY, Autoscaler, Behavior, Gauges, LagScaling, WorkScaling
from kvgate.producer.keys import PRIORITIES
from kvgate.producer.queue_work import SAMPLE, priority_work, stream_work

DAY_S = 86_400.0
RATE_WINDOW_S = 60.0  # the workers' window of served tokens (producer.keys.TENANT_WINDOW_S)


@dataclass(frozen=True, slots=True)
class Trace:
    seed: int = 44
    day_s: float = DAY_S
    interactive_per_s: float = 1.5  # mean arrivals; the rate swings +-80% over the day
    interactive_tokens: tuple[int, int] = (150, 1050)  # uniform prompt plus max_tokens
    batch_lines: int = 50_000
    batch_tokens: tuple[int, int] = (300, 900)
    window_s: float = 3600.0
    batch_at: float | None = None  # None: a random time, leaving the window inside the day

    def arrivals(self, batch: bool = True) -> list[tuple[float, str, int, float | None]]:
        """(time, priority, tokens, deadline) of every job, in time order."""
        rng, out, t = random.Random(self.seed), [], 0.0
        peak = self.interactive_per_s * 1.8
        while self.interactive_per_s > 0:
            t += rng.expovariate(peak)
            if t >= self.day_s:
                break
            if rng.random() < (1 + 0.8 * math.sin(2 * math.pi * t / self.day_s - math.pi / 2)) / 1.8:
                out.append((t, "high", rng.randint(*self.interactive_tokens), None))
        if batch and self.batch_lines:
            at = self.batch_time()
            out += [(at, "low", rng.randint(*self.batch_tokens), at + self.window_s) for _ in range(self.batch_lines)]
        return sorted(out, key=lambda a: a[0])

    def batch_time(self) -> float:
        if self.batch_at is not None:
            return self.batch_at
        return random.Random(self.seed + 1).uniform(0, self.day_s - 2 * self.window_s)


@dataclass(slots=True)
class Worker:
    created: float
    ready_at: float
    running: int = 0
    draining: bool = False
    ended: float | None = None


@dataclass(slots=True)
class Fleet:
    """The simulated fleet: `scaler` None holds `constant` workers all day, ready from the start."""

    trace: Trace
    scaler: str | None = "work"  # work | lag | None
    constant: int = 0
    slots: int = 16
    worker_tokens_per_s: float = 2000.0
    cold_start_s: float = 90.0
    behavior: Behavior = field(default_factory=Behavior)
    work: WorkScaling = field(default_factory=WorkScaling)

    def run(self, batch: bool = True) -> dict:
        return _Run(self).go(self.trace.arrivals(batch))


class _Run:
    def __init__(self, fleet: Fleet):
        self.f, self.now, self.seq = fleet, 0.0, itertools.count()
        self.events: list = []
        self.queues = {p: deque() for p in PRIORITIES}
        self.tokens = {p: 0.0 for p in PRIORITIES}
        self.workers: list[Worker] = []
        self.free: set[int] = set()
        self.served: deque = deque()
        self.served_sum = 0.0
        self.waits: dict[str, list[float]] = {p: [] for p in PRIORITIES}
        self.late, self.batch_done, self.batch_last = 0, 0, None
        self.replicas_seen: list[int] = []
        self.policy = fleet.work if fleet.scaler == "work" else LagScaling()
        self.scaler = Autoscaler(fleet.behavior, self.policy.targets()) if fleet.scaler else None

    def push(self, t: float, kind: str, data=None) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, data))

    def go(self, arrivals) -> dict:
        for a in arrivals:
            self.push(a[0], "arrive", a)
        self.lines = sum(a[3] is not None for a in arrivals)
        self.batch_from = min((a[0] for a in arrivals if a[3] is not None), default=0.0)
        if self.scaler is None:
            for _ in range(self.f.constant):
                self.add_worker(ready=True)
        else:
            self.push(0.0, "tick")
        end = self.f.trace.day_s
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            if t > end and kind == "tick" and not any(self.queues.values()) and not self.busy():
                break
            self.now = t
            getattr(self, f"on_{kind}")(data)
        for w in self.workers:
            if w.ended is None:
                w.ended = max(self.now, end)
        return self.report()

    def busy(self) -> bool:
        return any(w.running for w in self.workers if w.ended is None)

    # -- events ----------------------------------------------------------------------------------------------
    def on_arrive(self, a) -> None:
        _, priority, tokens, deadline = a
        self.queues[priority].append((self.now, tokens, deadline))
        self.tokens[priority] += tokens
        self.dispatch()

    def on_finish(self, data) -> None:
        i, tokens, deadline = data
        w = self.workers[i]
        w.running -= 1
        self.served.append((self.now, tokens))
        self.served_sum += tokens
        if deadline is not None:
            self.batch_done += 1
            self.batch_last = self.now
            self.late += self.now > deadline + 1e-9
        if w.draining:
            if not w.running:
                w.ended = self.now
            return
        self.free.add(i)
        self.dispatch()

    def on_ready(self, i: int) -> None:
        if self.workers[i].ended is None and not self.workers[i].draining:
            self.free.add(i)
            self.dispatch()

    def on_tick(self, _) -> None:
        current = sum(1 for w in self.workers if w.ended is None and not w.draining)
        values = self.values(self.gauges())
        want = self.scaler.replicas(self.now, values, current)
        for _ in range(want - current):
            self.add_worker(ready=False)
        if want < current:
            self.remove(current - want)
        self.replicas_seen.append(want)
        self.push(self.now + self.f.behavior.polling_s, "tick")

    # -- the fleet -------------------------------------------------------------------------------------------
    def dispatch(self) -> None:
        while self.free:
            job = next((p for p in PRIORITIES if self.queues[p]), None)
            if job is None:
                return
            i = min(self.free)
            w = self.workers[i]
            arrived, tokens, deadline = self.queues[job].popleft()
            self.tokens[job] -= tokens
            self.waits[job].append(self.now - arrived)
            w.running += 1
            if w.running >= self.f.slots:
                self.free.discard(i)
            service = tokens / (self.f.worker_tokens_per_s / self.f.slots)
            self.push(self.now + service, "finish", (i, tokens, deadline))

    def add_worker(self, ready: bool) -> None:
        w = Worker(self.now, self.now if ready else self.now + self.f.cold_start_s)
        self.workers.append(w)
        i = len(self.workers) - 1
        if ready:
            self.free.add(i)
        else:
            self.push(w.ready_at, "ready", i)

    def remove(self, n: int) -> None:
        """Pods not yet ready go first, then the least busy (a ReplicaSet's order, near enough)."""
        live = [i for i, w in enumerate(self.workers) if w.ended is None and not w.draining]
        live.sort(key=lambda i: (self.workers[i].ready_at <= self.now, self.workers[i].running))
        for i in live[:n]:
            w = self.workers[i]
            w.draining = True
            self.free.discard(i)
            if not w.running:
                w.ended = self.now

    # -- what the exporter publishes -------------------------------------------------------------------------
    def gauges(self) -> Gauges:
        while self.served and self.served[0][0] < self.now - RATE_WINDOW_S:
            self.served_sum -= self.served.popleft()[1]
        above, needed = 0.0, 0.0
        for p in PRIORITIES:
            q = self.queues[p]
            head = [(t, d) for _, t, d in itertools.islice(q, SAMPLE)]
            tail = [(t, d) for _, t, d in itertools.islice(reversed(q), max(0, min(SAMPLE, len(q) - SAMPLE)))][::-1]
            work = priority_work({p: stream_work(len(q), head, tail)}, [p], len(q), above, p, self.now)
            above, needed = work.tokens_through, max(needed, work.rate_needed())
        return Gauges(sum(len(q) for q in self.queues.values()), dict(self.tokens), needed,
                      self.served_sum / RATE_WINDOW_S)

    def values(self, g: Gauges) -> dict[str, float]:
        if isinstance(self.policy, WorkScaling):
            return self.policy.values(g)
        return self.policy.values(g, {p: len(q) for p, q in self.queues.items()})

    def report(self) -> dict:
        minutes = sum(w.ended - w.created for w in self.workers) / 60
        high = sorted(self.waits["high"])
        lines = self.lines
        return {"scaler": self.f.scaler or f"constant {self.f.constant}", "worker_minutes": round(minutes, 1),
                "batch_on_time": round(1 - self.late / lines, 5) if lines else None,
                "batch_done": self.batch_done,
                "batch_took_s": round(self.batch_last - self.batch_from, 1) if self.batch_last is not None else None,
                "interactive_p99_wait_s": round(high[int(0.99 * (len(high) - 1))], 3) if high else None,
                "max_replicas": max(self.replicas_seen, default=self.f.constant)}


def smallest(meets, low: int = 1, high: int = 256) -> int:
    """The least n in [low, high] with meets(n), meets being monotone; high when none below it meets."""
    while low < high:
        mid = (low + high) // 2
        if meets(mid):
            high = mid
        else:
            low = mid + 1
    return low


def w_scale(trace: Trace, **fleet) -> dict:
    """The whole benchmark: the work scaler, today's lag scaler, the interactive load alone, the best constant fleet
    over the day and the best constant batch fleet over the window (on top of the interactive load's own)."""
    on_time = 0.995
    alone = Fleet(trace, "work", **fleet).run(batch=False)
    work = Fleet(trace, "work", **fleet).run()
    lag = Fleet(trace, "lag", **fleet, behavior=TODAY).run()
    const_n = smallest(lambda n: Fleet(trace, None, n, **fleet).run()["batch_on_time"] >= on_time)
    constant = Fleet(trace, None, const_n, **fleet).run()
    batch_only = Trace(trace.seed, trace.day_s, 0.0, trace.interactive_tokens, trace.batch_lines, trace.batch_tokens,
                       trace.window_s, trace.batch_time())
    window_n = smallest(lambda n: Fleet(batch_only, None, n, **fleet).run()["batch_on_time"] >= on_time)
    window_minutes = alone["worker_minutes"] + window_n * trace.window_s / 60
    unloaded_p99 = alone["interactive_p99_wait_s"]
    for r in (work, lag):
        r["vs_constant_day"] = round(r["worker_minutes"] / constant["worker_minutes"], 3)
        r["vs_constant_window"] = round(r["worker_minutes"] / window_minutes, 3)
        r["interactive_p99_vs_unloaded"] = round(r["interactive_p99_wait_s"] / unloaded_p99, 2) if unloaded_p99 \
            else None
        r["meets"] = {"batch_on_time": r["batch_on_time"] >= on_time,
                      "interactive_p99": r["interactive_p99_wait_s"] <= 2 * unloaded_p99 + 1e-9,
                      "worker_minutes": r["worker_minutes"] <= 1.25 * constant["worker_minutes"],
                      "worker_minutes_vs_window": r["worker_minutes"] <= 1.25 * window_minutes}
    return {"trace": {"batch_at_s": round(trace.batch_time(), 1), "batch_lines": trace.batch_lines,
                      "window_s": trace.window_s, "interactive_per_s": trace.interactive_per_s},
            "unloaded": alone, "work": work, "lag": lag, "constant_day": constant,
            "constant_window": {"workers": window_n, "worker_minutes_with_interactive": round(window_minutes, 1)}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=44, help="the trace's seed (batch time, sizes, arrivals)")
    parser.add_argument("--batch-lines", type=int, default=50_000)
    parser.add_argument("--window-s", type=float, default=3600.0, help="the batch's completion window")
    parser.add_argument("--interactive-per-s", type=float, default=1.5, help="mean interactive arrivals per second")
    parser.add_argument("--cold-start-s", type=float, default=90.0, help="a worker's start before it serves")
    parser.add_argument("--worker-tokens-per-s", type=float, default=2000.0)
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")


def run(args: argparse.Namespace) -> int:
    trace = Trace(args.seed, batch_lines=args.batch_lines, window_s=args.window_s,
                  interactive_per_s=args.interactive_per_s)
    started = time.perf_counter()
    out = w_scale(trace, cold_start_s=args.cold_start_s, worker_tokens_per_s=args.worker_tokens_per_s,
                  work=WorkScaling(worker_tokens_per_s=args.worker_tokens_per_s))
    out["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"W-SCALE seed {args.seed}: batch of {trace.batch_lines} lines at {out['trace']['batch_at_s']} s, "
          f"window {trace.window_s:g} s; interactive p99 wait alone {out['unloaded']['interactive_p99_wait_s']} s")
    for name in ("work", "lag", "constant_day"):
        r = out[name]
        print(f"  {r['scaler']:<12} worker-min {r['worker_minutes']:>9} batch on time {r['batch_on_time']:.4f} "
              f"(done in {r['batch_took_s']} s) interactive p99 {r['interactive_p99_wait_s']} s  max replicas "
              f"{r['max_replicas']}"
              + (f"  vs constant day {r['vs_constant_day']} window {r['vs_constant_window']} meets {r['meets']}"
                 if "meets" in r else ""))
    print(f"  constant batch fleet over the window: {out['constant_window']}; {out['wall_s']} s")
    return 0
