"""Cancellation: a client sets a job's cancel flag; the worker reads the flags of the jobs it holds, one MGET per
shard, polled in the step's round trip and checked once more when a job that waited in Redis is read."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import islice
from typing import Iterator

from kvgate.producer.keys import Keys
from kvgate.worker.admission import Ticket


@dataclass(slots=True)
class CancelFlags:
    """The MGETs of one poll on their way: the tickets whose flag is set, once settled."""

    tickets: list[Ticket]  # in the order of the flags (shard by shard)
    n: int  # MGETs, one per shard
    flagged: list[Ticket] = field(default_factory=list)

    def take(self, replies: Iterator) -> None:
        flags = [flag for reply in islice(replies, self.n) for flag in reply]
        self.flagged = [t for t, flag in zip(self.tickets, flags) if flag is not None]


@dataclass(slots=True)
class Cancellation:
    keys: Keys
    poll_ms: int
    next_poll_at: float = 0.0

    def due(self, holding: bool) -> bool:
        """Whether to poll the flags of the jobs we hold in this round trip."""
        if not holding:
            return False
        now = time.monotonic()
        if now < self.next_poll_at:
            return False
        self.next_poll_at = now + self.poll_ms / 1000
        return True

    def queue(self, pipe, tickets: list[Ticket]) -> CancelFlags:
        groups = self.keys.by_shard(tickets, lambda t: t.stream)
        for g in groups:
            pipe.execute_command("MGET", *[self.keys.of_stream(t.stream).cancel(t.job.job_id) for t in g])
        return CancelFlags([t for g in groups for t in g], len(groups))

    def before_start(self, client, tickets: list[Ticket]) -> set[str]:
        """The keys of jobs just read whose client cancelled them while they waited in Redis. Only a job that
        waited can have been cancelled while queued; sparing fresh ones the round trip keeps an idle worker's
        admission fast, and the periodic poll still catches a late flag."""
        recent = time.time() - self.poll_ms / 1000
        waited = [t for t in tickets if t.job.enqueued_at < recent]
        if not waited:
            return set()
        groups = self.keys.by_shard(waited, lambda t: t.stream)
        replies = [client.execute_command("MGET", *[self.keys.of_stream(t.stream).cancel(t.job.job_id) for t in g])
                   for g in groups]
        flags = [flag for reply in replies for flag in reply]
        return {t.key for t, flag in zip((t for g in groups for t in g), flags) if flag is not None}
