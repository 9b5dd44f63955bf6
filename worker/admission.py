"""KV-capacity admission: how many jobs to read from Redis now, and the bounded local queue of jobs read
that did not fit yet. Redis stays the fleet's waiting room: a worker never holds more than its engine can
admit plus this small queue (invariant 4)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from kvgate.engine.sampling_params import SamplingParams
from kvgate.producer.protocol import Job

MAX_MOVE = 2.0  # one job's tokens count as at most twice (at least half) the estimate: a step of 1.2x (0.9x)
LIKELY_SHARED = 0.8  # share of recent jobs that came with a prefix we held, above which we read one job more


@dataclass(slots=True)
class Ticket:
    """A job read from Redis, decoded and tokenized, not yet in the engine."""

    job: Job
    stream: str
    entry_id: str
    prompt_ids: list[int]
    params: SamplingParams
    payload: bytes
    attempt: int = 1  # the entry's delivery count: tags this run's deltas so a client never splices two runs
    shared: int = 0  # leading prompt tokens the engine held in its prefix cache when the job was read
    hashes: list[int] = field(default_factory=list)  # the prompt's block hashes, kept for each fit check
    pooling: Any = None  # an embedding job's PoolingParams: it generates nothing, so its budget is 0
    tool_parser: str | None = None  # a job with tools of choice auto: the format its calls are read in
    may_preempt: bool = False  # fair share: its tenant had few jobs waiting, so it may make room (worker/room.py)
    queued_at: float = 0.0  # when it entered the local queue (monotonic): one waiting long goes back (hand_back.py)
    lora: str | None = None  # the LoRA adapter it runs with (its model names one: worker/adapters.py)
    lora_path: str | None = None  # that adapter's folder, read on its first job here

    @property
    def key(self) -> str:
        return f"{self.stream}|{self.entry_id}"

    @property
    def budget(self) -> int:
        """Output tokens it may generate: none for an embedding."""
        return 0 if self.pooling is not None else self.params.max_tokens

    @property
    def tokens(self) -> int:
        """Prompt plus output budget; the worker clamps the budget to what the engine will run."""
        return len(self.prompt_ids) + self.budget


@dataclass(slots=True)
class AdmissionQueue:
    size: int
    tokens_per_job: float  # running estimate of prompt + output tokens per job
    tickets: deque[Ticket] = field(default_factory=deque)
    shared_rate: float = 0.0  # running share of jobs whose prefix the engine held when they were read
    shared_tokens: float = 0.0  # running estimate of the tokens such a job shares

    def __len__(self) -> int:
        return len(self.tickets)

    def read_count(self, free_seqs: int, admissible_tokens: int, engine_idle: bool) -> int:
        """Jobs to read now: what the engine can take beyond what already waits here. Never more than free
        sequence slots plus free queue room, so the engine's jobs plus this queue stay within the bound
        max_num_seqs + size, however wrong the token estimate turns out."""
        est = max(self.tokens_per_job, 1.0)
        fit_now = min(free_seqs, int(admissible_tokens // est))
        if self._one_more(fit_now < free_seqs, admissible_tokens - fit_now * est):
            fit_now += 1
        if engine_idle and not self.tickets:
            fit_now = max(fit_now, 1)  # an idle engine always takes one job, or rejects it with a reason
        waiting = len(self.tickets)
        return max(0, min(fit_now - waiting, free_seqs + self.size - waiting))

    def _one_more(self, seq_free: bool, room: float) -> bool:
        """A job whose prefix the engine holds claims only its own tail of the KV cache, but which job comes
        next is unknown until it is read: when nearly every recent one shared a held prefix (a lane's jobs
        reaching its owner), read one more job if the room left covers such a tail. One at a time and none while
        a job waits here, so a wrong guess costs one job's wait here, never more."""
        return (seq_free and not self.tickets and self.shared_rate >= LIKELY_SHARED
                and room >= self.tokens_per_job - self.shared_tokens)

    def observe(self, ticket: Ticket) -> None:
        """Move the estimates toward this job, the size by at most MAX_MOVE either way: one outlier (a budget far
        past what the engine will run, a one-token job) must not stall admission or flood the engine."""
        est = self.tokens_per_job
        sample = min(max(ticket.tokens, est / MAX_MOVE), est * MAX_MOVE)
        self.tokens_per_job = est + 0.2 * (sample - est)
        self.shared_rate += 0.2 * ((ticket.shared > 0) - self.shared_rate)
        if ticket.shared:
            self.shared_tokens += 0.2 * (ticket.shared - self.shared_tokens)

    def push(self, ticket: Ticket) -> None:
        self.observe(ticket)
        ticket.queued_at = time.monotonic()
        self.tickets.append(ticket)

    def head(self, ready: Callable[[Ticket], bool] | None = None) -> Ticket | None:
        """The first ticket, or with `ready` the first it says may start (one whose LoRA adapter is still read from
        disk, or has no slot yet, is passed over: Flights.adapter_ready); `remove` takes it out."""
        return next((t for t in self.tickets if ready is None or ready(t)), None)

    def remove(self, ticket: Ticket) -> None:
        self.tickets.remove(ticket)

    def discard(self, keys: list[str]) -> None:
        """Drop the tickets of these jobs (another worker runs them now)."""
        for key in keys:
            if (ticket := next((t for t in self.tickets if t.key == key), None)) is not None:
                self.tickets.remove(ticket)

    def take_all(self) -> list[Ticket]:
        """Every ticket, in order, leaving the queue empty (draining: they go back to Redis)."""
        tickets = list(self.tickets)
        self.tickets.clear()
        return tickets
