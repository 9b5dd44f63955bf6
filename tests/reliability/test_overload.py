"""Overload: a producer keeps ten times more jobs waiting than two `kvgate worker --simulated` processes can
hold, for minutes. Worker RSS stays flat, Redis memory levels off under the trimming policies (job streams
trimmed behind acks, reply streams capped and trimmed by their reader, results with a TTL), preemptions per 1000
generated tokens are reported from the workers' own Prometheus counters, the backlog is visible in
Client.stats() the whole time while each worker holds no more than its bound (invariant 4), and every job is
answered once at the end.

`KVGATE_SLOW=1 .venv/bin/pytest -s -m slow tests/reliability/test_overload.py` runs the 120 s version
(KVGATE_OVERLOAD_S to change it); the default run has a 20 s version with the same checks but RSS and memory."""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import time
import urllib.request
from dataclasses import dataclass, field

import psutil
import pytest

from tests.reliability.chaos_harness import stop_all
from kvgate.producer import Client
from kvgate.producer.keys import Keys, as_text
from tests.support import free_port, spawn_worker, wait_for

MAX_SEQS, LOCAL_QUEUE = 16, 4
HOLD_BOUND = MAX_SEQS + LOCAL_QUEUE + 3  # running + local queue + one blocking read's worth per stream
CAPACITY = 2 * HOLD_BOUND
ENV = {"KVGATE_RESULT_TTL_S": "30", "KVGATE_REPLY_MAXLEN": "2000", "KVGATE_TRIM_INTERVAL_S": "2"}


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for name in ("kvgate_preemptions_total", "kvgate_generation_tokens_total"):
        out[name] = sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))
    return out


def answers(port: int) -> bool:
    try:
        scrape(port)
    except OSError:
        return False
    return True


@dataclass
class Samples:
    t: list[float] = field(default_factory=list)
    rss_mb: list[list[float]] = field(default_factory=list)
    redis_mb: list[float] = field(default_factory=list)
    backlog: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # the most jobs any one worker held

    def late_growth(self, series: list[float], warm_s: float) -> float:
        """Median of the last third minus the median of the first third after warm-up."""
        kept = [v for t, v in zip(self.t, series) if t >= warm_s]
        third = max(1, len(kept) // 3)
        return statistics.median(kept[-third:]) - statistics.median(kept[:third])


def overload(server, ns, tmp_path, duration_s: float) -> tuple[dict, Samples]:
    ports = [free_port(), free_port()]
    # 2.5 ms steps: the 12x backlog left at the end drains in half the time (the overload itself lasts duration_s)
    args = ("--simulated", "--sim-num-blocks", "256", "--block-size", "16", "--max-num-seqs", str(MAX_SEQS),
            "--local-queue-size", str(LOCAL_QUEUE), "--sim-step-ms", "2.5", "--sim-per-token-ms", "0.05")
    workers = [spawn_worker(server.url, ns, *args, "--metrics-port", str(ports[i]), worker_id=f"o{i}",
                            log=tmp_path / f"o{i}.log", env=ENV) for i in range(2)]
    procs = [psutil.Process(w.pid) for w in workers]
    r, keys, samples, handles = server.client(), Keys(ns), Samples(), []
    client = Client(server.url, ns)
    words = "paged attention block table prefix cache decode prefill".split()
    try:
        # the overload's clock starts once both workers answer on their metrics port: on a loaded machine their
        # start-up took most of the 20 s, and the final scrape found a worker not yet listening
        wait_for(lambda: all(answers(p) for p in ports), 120, "both workers' metrics ports")
        t0 = time.monotonic()
        while (now := time.monotonic() - t0) < duration_s:
            stats = client.stats()
            if stats.backlog < 10 * CAPACITY:  # top up to 12x what the fleet can hold
                n = 12 * CAPACITY - stats.backlog
                handles += client.submit_many([{"prompt": " ".join(words * (1 + i % 10)), "max_tokens": 20 + i % 280}
                                               for i in range(n)], progress=False)
            samples.t.append(now)
            samples.rss_mb.append([p.memory_info().rss / 2**20 for p in procs])
            samples.redis_mb.append(r.info("memory")["used_memory"] / 2**20)
            samples.backlog.append(client.stats().backlog)
            held = [row["pending"] for st in keys.all_jobs(None) for row in r.xinfo_consumers(st, Keys.GROUP)
                    if as_text(row["name"]) != Keys.PARKED]  # the deadline order's window is held by no worker
            samples.held.append(max(held, default=0))
            time.sleep(1.0)
        counters = [scrape(p) for p in ports]
        statuses = [h.result(timeout=duration_s + 120).status for h in handles]
        drained_s = time.monotonic() - t0 - duration_s
        alive = [w.poll() is None for w in workers]
        for w in workers:
            w.send_signal(signal.SIGTERM)
        exits = [w.wait(60) for w in workers]
    finally:
        client.close()
        stop_all(workers)
    preempt = sum(c["kvgate_preemptions_total"] for c in counters)
    tokens = sum(c["kvgate_generation_tokens_total"] for c in counters)
    report = dict(seconds=duration_s, jobs=len(handles), done=statuses.count("done"), drained_s=round(drained_s, 1),
                  fleet_holds=CAPACITY, backlog_min=min(samples.backlog[2:]), backlog_max=max(samples.backlog),
                  max_held_by_one_worker=max(samples.held), generated_tokens=int(tokens), preemptions=int(preempt),
                  preemptions_per_1000_tokens=round(1000 * preempt / max(tokens, 1), 3),
                  rss_mb_start=[round(v, 1) for v in samples.rss_mb[min(5, len(samples.t) - 1)]],
                  rss_mb_end=[round(v, 1) for v in samples.rss_mb[-1]],
                  redis_mb_max=round(max(samples.redis_mb), 1), redis_mb_end=round(samples.redis_mb[-1], 1),
                  alive=alive, exit_codes=exits)
    print("\noverload report:", json.dumps(report, indent=1))
    return report, samples


def check_common(report: dict) -> None:
    assert report["done"] == report["jobs"] > 10 * CAPACITY, report
    assert report["backlog_min"] >= 5 * CAPACITY, report  # the waiting room is Redis, visible to stats()
    assert report["max_held_by_one_worker"] <= HOLD_BOUND, report
    assert report["preemptions_per_1000_tokens"] < 5.0, report
    assert all(report["alive"]) and report["exit_codes"] == [0, 0], report


def test_a_20s_overload_keeps_the_backlog_in_redis_and_answers_every_job(redis_server, namespace, tmp_path):
    report, _ = overload(redis_server, namespace, tmp_path, 20.0)
    check_common(report)


@pytest.mark.slow
def test_minutes_of_overload_keep_worker_rss_flat_and_redis_memory_bounded(redis_server, namespace, tmp_path):
    duration = float(os.environ.get("KVGATE_OVERLOAD_S", "120"))
    report, samples = overload(redis_server, namespace, tmp_path, duration)
    check_common(report)
    for i in range(2):
        growth = samples.late_growth([s[i] for s in samples.rss_mb], warm_s=20)
        assert growth < 8.0, f"worker {i} RSS grew {growth:.1f} MiB between the first and last third"
    redis_growth = samples.late_growth(samples.redis_mb, warm_s=40)  # past the 30 s result TTL: steady state
    assert redis_growth < 0.25 * statistics.median(samples.redis_mb) + 2.0, f"Redis memory grew {redis_growth:.1f} MiB"
