"""Producer test helpers: a fake worker made of real Redis commands."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from kvgate.producer import Client
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD, PROTOCOL_VERSION, Delta, Final, Job, Timings, Usage, decode_job, encode
from tests.support import ROOT, free_port


@dataclass
class FakeWorker:
    """Plays the worker's part with the same Redis commands the real one uses."""

    r: redis.Redis
    keys: Keys
    name: str = "fake-worker"
    model: str | None = None  # the model whose streams it reads; None: `default`
    taken: dict[str, tuple[str, str]] = field(default_factory=dict)  # job_id -> (stream, entry id)

    def ensure_groups(self) -> None:
        if self.model is not None:  # a worker makes the models it serves known when it starts
            self.r.sadd(self.keys.models(), self.model)
        for priority in ("high", "normal", "low"):
            try:
                self.r.xgroup_create(self.keys.jobs(self.model, priority), Keys.GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def take(self, priority: str = "normal", count: int = 10, block_ms: int = 2000) -> list[Job]:
        stream = self.keys.jobs(self.model, priority)
        reply = self.r.xreadgroup(Keys.GROUP, self.name, {stream: ">"}, count=count, block=block_ms)
        jobs = []
        for entry_id, fields in (reply[0][1] if reply else []):
            job = decode_job(fields[FIELD.encode()])
            self.taken[job.job_id] = (stream, entry_id.decode())
            jobs.append(job)
        return jobs

    def delta(self, job: Job, index: int, text: str, token_ids: list[int]) -> None:
        event = Delta(v=PROTOCOL_VERSION, job_id=job.job_id, index=index, text=text, token_ids=token_ids)
        self.r.xadd(self.keys.reply(job.client_id), {FIELD: encode(event)})

    def final(self, job: Job, status: str = "done", text: str = "", token_ids: list[int] | None = None,
              publish: bool = True, **extra) -> Final:
        now = time.time()
        final = Final(v=PROTOCOL_VERSION, job_id=job.job_id, status=status, text=text, token_ids=token_ids or [],
                      finish_reason=extra.pop("finish_reason", "stop" if status == "done" else None),
                      usage=Usage(prompt_tokens=3, completion_tokens=len(token_ids or [])), worker=self.name,
                      timings=Timings(queued=job.enqueued_at, admitted=now, first_token=now, finished=now + 0.5),
                      metadata=job.metadata, **extra)
        stream, entry_id = self.taken[job.job_id]
        pipe = self.r.pipeline(transaction=True)  # result, reply and ack in one step, as the worker does
        pipe.set(self.keys.result(job.job_id), encode(final), ex=600)
        if publish:
            pipe.xadd(self.keys.reply(job.client_id), {FIELD: encode(final)})
        pipe.xack(stream, Keys.GROUP, entry_id)
        pipe.execute()
        return final


@pytest.fixture
def keys(namespace) -> Keys:
    return Keys(namespace)


@pytest.fixture
def client(redis_url, namespace):
    with Client(redis_url, namespace) as c:
        yield c


@pytest.fixture
def fake_worker():
    """FakeWorker itself, for tests that run their own Redis."""
    return FakeWorker


@pytest.fixture
def unused_port() -> int:
    return free_port()


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def worker(redis_server, keys):
    r = redis_server.client()
    yield FakeWorker(r, keys)
    r.close()
