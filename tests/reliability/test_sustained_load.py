"""Worker-side queue correctness under sustained load (issue 14, items 1 and 7), against `kvgate worker
--simulated` processes and a real redis-server.

1. A SIGKILLed worker's jobs are taken over within the reclaim timeout plus a few steps, ahead of new entries,
   while a producer keeps the survivor saturated (before the fix they waited until the producer stopped).
7. One job with max_tokens=1,000,000 ahead of ordinary ones does not stall admission: the estimate uses the
   budget clamped to max_model_len, and no single job moves it by more than a bounded factor.
"""
from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter

import redis

from tests.reliability.chaos_harness import Ledger, stop_all
from tests.support import RawQueue, spawn_worker, wait_for
from kvgate.engine.sampling_params import SamplingParams
from kvgate.producer.keys import Keys
from kvgate.worker.admission import AdmissionQueue, Ticket

RECLAIM_MS = 2000
ENV = {"OMP_NUM_THREADS": "1"}


def sim_args(max_seqs: int, step_ms: float, *extra: str) -> tuple[str, ...]:
    return ("--simulated", "--sim-num-blocks", "2048", "--max-num-seqs", str(max_seqs), "--sim-step-ms", str(step_ms),
            "--sim-per-token-ms", "0", "--reclaim-idle-ms", str(RECLAIM_MS), *extra)


def pending_of(r: redis.Redis, stream: str) -> Counter:
    return Counter(row["consumer"].decode() for row in r.xpending_range(stream, Keys.GROUP, "-", "+", 1000))


def final_times(r: redis.Redis, keys: Keys, client_id: str) -> dict[str, float]:
    """job id -> when its final event landed, by the stream id's server clock (seconds)."""
    from kvgate.producer.protocol import FIELD, Final, decode_event

    out = {}
    for entry_id, fields in r.xrange(keys.reply(client_id)):
        event = decode_event(fields[FIELD.encode()])
        if isinstance(event, Final):
            out[event.job_id] = int(entry_id.decode().split("-")[0]) / 1000
    return out


def server_now(r: redis.Redis) -> float:
    seconds, micros = r.time()
    return seconds + micros / 1e6


class Producer(threading.Thread):
    """Keeps about `depth` jobs waiting undelivered in one stream until stopped."""

    def __init__(self, queue: RawQueue, depth: int, max_tokens: int):
        super().__init__(daemon=True)
        self.queue, self.depth, self.max_tokens = queue, depth, max_tokens
        self.stop, self.submitted, self.error = threading.Event(), [], None
        self.rng = random.Random(14)
        self.stream = queue.keys.jobs(None, "normal")

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                for _ in range(max(0, self.depth - self.undelivered())):
                    tokens = self.rng.randint(self.max_tokens // 2, self.max_tokens * 3 // 2)  # slots free one by one
                    self.submitted.append(self.queue.submit("load", max_tokens=tokens, ignore_eos=True))
                time.sleep(0.05)
        except Exception as e:  # reported by the test, not lost in a thread
            self.error = e

    def undelivered(self) -> int:
        r = self.queue.r
        last = next(g["last-delivered-id"] for g in r.xinfo_groups(self.stream) if g["name"] == b"workers")
        return len(r.xrange(self.stream, min=b"(" + last, max="+", count=self.depth))


def test_a_killed_workers_jobs_are_taken_over_within_the_reclaim_timeout_under_sustained_load(
        redis_server, namespace, tmp_path):
    r, keys = redis_server.client(), Keys(namespace)
    stream = keys.jobs(None, "normal")
    r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    orphans_q, load_q = RawQueue(redis_server, namespace), RawQueue(redis_server, namespace)
    # the victim is slow (a 200-token job takes 12 s there), the survivor fast (1 s): the orphans' latency is
    # the takeover, not the generation
    victim = spawn_worker(redis_server.url, namespace, *sim_args(4, 60), worker_id="victim", log=tmp_path / "victim.log", env=ENV)
    survivor = None
    producer = Producer(load_q, depth=20, max_tokens=60)
    try:
        orphans = [orphans_q.submit("orphan", max_tokens=200, ignore_eos=True, stream=True) for _ in range(4)]
        wait_for(lambda: pending_of(r, stream)["victim"] == 4, timeout=30, what="the victim to hold the 4 jobs")
        survivor = spawn_worker(redis_server.url, namespace, *sim_args(4, 5), worker_id="survivor",
                                log=tmp_path / "survivor.log", env=ENV)
        producer.start()
        wait_for(lambda: pending_of(r, stream)["survivor"] >= 4, timeout=30, what="the survivor to be saturated")
        time.sleep(1.0)
        assert pending_of(r, stream)["victim"] == 4 and not final_times(r, keys, orphans_q.client_id)
        killed_at = server_now(r)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        budget_s = RECLAIM_MS / 1000 + 1.0 + 1.0 + 4.0  # timeout + reclaim interval + 200 fast steps + slack
        deadline = time.monotonic() + budget_s + 10  # keep the load on well past the budget
        while time.monotonic() < deadline and len(final_times(r, keys, orphans_q.client_id)) < 4:
            time.sleep(0.1)
        load_running = producer.is_alive()
        producer.stop.set()
        producer.join(5)
        done = final_times(r, keys, orphans_q.client_id)
        late = {j: round(done[j] - killed_at, 1) if j in done else None for j in orphans}
        print(f"orphans finished {list(late.values())} s after the kill (None: not yet); {len(producer.submitted)} load jobs")
        assert producer.error is None, f"the producer failed: {producer.error!r}"
        assert load_running and len(done) == 4, f"orphans finished (s after the kill, None: not yet) {late}"
        assert max(late.values()) <= budget_s, f"orphans took over {budget_s:.0f}s after the kill: {late}"
        wait_for(lambda: Ledger(r, keys).pending() == 0, timeout=30, what="the load to drain")
        counts = Ledger(r, keys).final_counts([orphans_q.client_id, load_q.client_id])
        assert set(counts.values()) == {1} and len(counts) == 4 + len(producer.submitted)
    finally:
        producer.stop.set()
        stop_all([p for p in (victim, survivor) if p is not None])


def ticket(prompt_len: int, max_tokens: int) -> Ticket:
    return Ticket(None, "s", "0-1", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), b"")


def test_one_job_moves_the_tokens_per_job_estimate_by_a_bounded_factor():
    queue = AdmissionQueue(size=4, tokens_per_job=100.0)
    queue.observe(ticket(10, 1_000_000))
    assert queue.tokens_per_job <= 100.0 * 1.25
    queue.observe(ticket(1, 1))
    assert queue.tokens_per_job >= 100.0


def test_one_more_job_is_read_only_while_recent_jobs_shared_a_held_prefix_and_none_wait_here():
    queue = AdmissionQueue(size=4, tokens_per_job=1000.0)
    assert queue.read_count(8, 1500, False) == 1  # room for one whole job
    for _ in range(10):
        queue.observe(shared_ticket(1000, 800))
    assert queue.read_count(8, 1500, False) == 2  # and for the tail of one that shares the usual prefix
    assert queue.read_count(8, 1100, False) == 1  # the room left (100) does not cover a tail (~200)
    queue.tickets.append(shared_ticket(1000, 800))
    assert queue.read_count(8, 2500, False) == 1  # a job waits here: read only what surely fits
    queue.tickets.clear()
    for _ in range(10):
        queue.observe(shared_ticket(1000, 0))
    assert queue.read_count(8, 1500, False) == 1  # jobs stopped sharing: no guessing


def shared_ticket(tokens: int, shared: int) -> Ticket:
    t = ticket(tokens - 1, 1)
    t.shared = shared
    return t


def test_a_huge_max_tokens_job_does_not_stall_admission_of_ordinary_ones(redis_server, namespace, tmp_path):
    r, keys = redis_server.client(), Keys(namespace)
    stream = keys.jobs(None, "normal")
    r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    queue = RawQueue(redis_server, namespace)
    worker = spawn_worker(redis_server.url, namespace, *sim_args(16, 10), worker_id="w", log=tmp_path / "w.log", env=ENV)
    try:
        wait_for(lambda: r.exists(keys.worker("w")), timeout=30, what="the worker's heartbeat")
        queue.submit("huge", max_tokens=1_000_000, ignore_eos=True)  # clamped to max_model_len: 40 s of steps
        wait_for(lambda: pending_of(r, stream)["w"] == 1, timeout=10, what="the worker to start the huge job")
        started = time.monotonic()
        ordinary = [queue.submit("ordinary", max_tokens=20, ignore_eos=True) for _ in range(100)]
        held = 0
        while time.monotonic() - started < 15:
            held = max(held, pending_of(r, stream)["w"])
            done = final_times(r, keys, queue.client_id)
            if all(j in done for j in ordinary):
                break
            time.sleep(0.05)
        makespan = time.monotonic() - started
        finished = sum(j in done for j in ordinary)
        print(f"{finished}/100 ordinary jobs in {makespan:.1f}s behind the huge one; the worker held at most {held}")
        assert finished == 100, f"{finished}/100 ordinary jobs done in {makespan:.1f}s; the worker held at most {held}"
        assert makespan < 8, f"100 ordinary jobs took {makespan:.1f}s behind the huge one"
        assert held >= 12, f"the worker held at most {held} jobs with 16 sequence slots"
    finally:
        stop_all([worker])
