"""Deadlines on the Redis server's clock (invariant 9), never by comparing two machines' clocks.

A job's time limit starts when Redis accepted it: its stream entry id's millisecond part is the server's
clock at XADD. Its length is `deadline - enqueued_at`, both stamped by the producer's own clock, so the
producer's offset cancels out. The worker reads the server's clock (TIME) now and then and keeps the offset
to its own, so a worker whose clock is 30 s off expires jobs exactly like one whose clock is right.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import redis

from kvgate.producer.protocol import Job

# The one seam for "this machine's clock" that tests can skew in a worker subprocess when libfaketime is missing.
LOCAL_SKEW_ENV = "KVGATE_TEST_LOCAL_CLOCK_SKEW_S"
_SKEW_S = float(os.environ.get(LOCAL_SKEW_ENV) or 0.0)


def local_time() -> float:
    return time.time() + _SKEW_S


def entry_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


@dataclass(slots=True)
class ServerClock:
    client: redis.Redis
    resync_s: float = 5.0
    offset_s: float = 0.0  # server clock minus local clock
    synced_at: float = float("-inf")  # monotonic

    def sync(self) -> None:
        before = local_time()
        seconds, micros = self.client.time()
        after = local_time()
        self.offset_s = seconds + micros / 1e6 - (before + after) / 2
        self.synced_at = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.synced_at >= self.resync_s

    def now(self) -> float:
        """The server's clock now, in unix seconds, from the last offset (kept across Redis outages)."""
        return local_time() + self.offset_s

    def expired(self, job: Job, entry_id: str) -> bool:
        if job.deadline is None:
            return False
        if job.enqueued_at <= 0:  # no start stamp to measure the limit from: the deadline is all there is
            return job.deadline < self.now()
        return entry_ms(entry_id) / 1000 + (job.deadline - job.enqueued_at) < self.now()
