"""Shared by the reliability tests: the raw reply-stream ledger (XRANGE, not the SDK) and the fault timeline of
the chaos runs. Raw job injection and `kvgate worker` subprocesses are tests.support's RawQueue and spawn_worker."""
from __future__ import annotations

import random
import signal
from collections import Counter
from dataclasses import dataclass

import redis

from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD, Final, decode_event


@dataclass
class Ledger:
    """What Redis itself says happened to the jobs of one namespace: every Final in the given reply streams
    (raw XRANGE), what is still pending, and the dead stream."""

    r: redis.Redis
    keys: Keys

    def finals(self, client_ids) -> list[Final]:
        out = []
        for client_id in client_ids:
            for _, fields in self.r.xrange(self.keys.reply(client_id)):
                event = decode_event(fields[FIELD.encode()])
                if isinstance(event, Final):
                    out.append(event)
        return out

    def final_counts(self, client_ids) -> Counter:
        return Counter(f.job_id for f in self.finals(client_ids))

    def pending(self) -> int:
        total = 0
        for stream in self.keys.all_jobs(None):
            try:
                total += self.r.xpending(stream, Keys.GROUP)["pending"]
            except redis.ResponseError:  # no group: nothing was ever read
                pass
        return total

    def dead(self) -> list[dict]:
        return [fields for _, fields in self.r.xrange(self.keys.dead())]


@dataclass
class Fault:
    kind: str  # kill | redis_restart | redis_freeze
    after_finals: int  # fires once this many jobs have a final event: a moment mid-run on any machine speed
    jitter_s: float


def fault_plan(seed: int, jobs: int, kills: int = 3, restarts: int = 1, freezes: int = 1) -> list[Fault]:
    """Seeded random moments between 8% and 80% of the run, in a seeded random order."""
    rng = random.Random(seed)
    kinds = ["kill"] * kills + ["redis_restart"] * restarts + ["redis_freeze"] * freezes
    rng.shuffle(kinds)
    moments = sorted(rng.sample(range(int(jobs * 0.08), int(jobs * 0.8)), len(kinds)))
    return [Fault(k, m, rng.uniform(0.0, 0.5)) for k, m in zip(kinds, moments)]


def stop_all(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
