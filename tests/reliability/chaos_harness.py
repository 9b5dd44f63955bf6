"""Shared by the reliability tests: raw job injection, the raw reply-stream ledger (XRANGE, not the SDK),
`kvgate worker` subprocesses, and the fault timeline of the chaos runs."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvgate.producer.request import build_job, encode_job, validate_request
from kvgate.producer.protocol import FIELD, PRIORITIES, PROTOCOL_VERSION, Final, Job, Keys, Sampling, decode_event, encode

ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float = 30.0, what="condition", every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what() if callable(what) else what}")


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
        for stream in self.keys.all_jobs():
            try:
                total += self.r.xpending(stream, Keys.GROUP)["pending"]
            except redis.ResponseError:  # no group: nothing was ever read
                pass
        return total

    def dead(self) -> list[dict]:
        return [fields for _, fields in self.r.xrange(self.keys.dead())]


@dataclass
class RawQueue:
    """A producer that writes wire payloads straight into the job streams (no SDK validation in the way)."""

    r: redis.Redis
    keys: Keys
    client_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def job(self, prompt: str | None = "hello world", **kw) -> Job:
        sampling = Sampling(**{k: kw.pop(k) for k in list(kw) if k in Sampling.__struct_fields__})
        return Job(v=PROTOCOL_VERSION, job_id=kw.pop("job_id", uuid.uuid4().hex), client_id=self.client_id,
                   enqueued_at=time.time(), prompt=prompt, sampling=sampling, **kw)

    def xadd(self, payload: bytes, priority: str = "normal", field_name: str = FIELD) -> str:
        return self.r.xadd(self.keys.jobs(priority), {field_name: payload}).decode()

    def submit(self, prompt: str = "hello world", **kw) -> str:
        job = self.job(prompt, **kw)
        self.xadd(encode(job), job.priority)
        return job.job_id

    def submit_validated(self, requests: list[dict]) -> list[str]:
        """Jobs built and validated exactly as the SDK builds them, but with no SDK reader on the reply stream:
        the SDK trims what it has read, and a ledger must see every event ever written."""
        jobs = [build_job(validate_request(kw), self.client_id) for kw in requests]
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            pipe.xadd(self.keys.jobs(job.priority), {FIELD: encode_job(job)})
        pipe.execute()
        return [job.job_id for job in jobs]


def worker_command(url: str, ns: str, worker_id: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvgate.cli", "worker", "--redis-url", url, "--namespace", ns,
            "--worker-id", worker_id, *args]


def spawn_worker(url: str, ns: str, worker_id: str, *args: str, log: Path | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """`kvgate worker` in its own process, so SIGKILL is a real crash; its log goes to `log`."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(worker_command(url, ns, worker_id, *args), cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT)


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


__all__ = ["Ledger", "RawQueue", "Fault", "fault_plan", "spawn_worker", "stop_all", "wait_for", "PRIORITIES"]
