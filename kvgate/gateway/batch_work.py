"""One batch's requests through the fleet: submit a window at a time, record each answer as it arrives.

Every line's job carries an idempotency key from the batch id and its custom_id, so a replica resuming a
batch that another one started reattaches to the jobs already queued or finished instead of running them
again; lines already answered are not submitted at all.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvgate.producer import AsyncClient, Backpressure, JobLost, KvgateError, PartiallySubmitted
from kvgate.openai.batch import BatchRequest, answer_line, is_success, plan_line, request_lines

from .batch_store import Batch, BatchStore

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.5  # how often a running batch looks for a cancel or its expiry
RETRY_S = 1.0  # wait after a refused submit (backpressure, Redis refusing writes)
SUBMIT_CHUNK = 32  # the SDK checks the backlog before each chunk, so a batch stops at --max-backlog


@dataclass(slots=True)
class Work:
    """The state of one batch's run in this replica."""

    batch: Batch
    client: AsyncClient
    store: BatchStore
    window: int
    priority: str
    chunk: int = SUBMIT_CHUNK  # at most max_backlog, so one chunk cannot overshoot it
    todo: deque[BatchRequest] = field(default_factory=deque)
    pending: dict[asyncio.Task, tuple[BatchRequest, str]] = field(default_factory=dict)
    models: dict[str, str | None] = field(default_factory=dict)

    async def plan(self, data: bytes) -> None:
        """Queue the lines not yet answered; lines that fail on their own are answered with their error now."""
        b, answered = self.batch, await self.store.answered(self.batch.id)
        keys, client_id = self.client.keys, self.client.client_id
        # in a thread: validating tens of thousands of lines would hold up every other request of this gateway
        lines = await asyncio.to_thread(lambda: [plan_line(n, raw, b.id, self.priority, keys, client_id)
                                                 for n, raw in request_lines(data)])
        rejected = []
        for planned in lines:
            if isinstance(planned, BatchRequest):
                if planned.custom_id not in answered:
                    self.todo.append(planned)
            elif planned["custom_id"] not in answered:
                rejected.append((planned["custom_id"], planned, False))
        if rejected:
            await self.store.record_many(b.id, rejected)

    async def run(self) -> str:
        """Until every line is answered ('done'), or the batch is cancelled or past its window (that status)."""
        checked = 0.0
        try:
            while self.todo or self.pending:
                if time.monotonic() - checked > CHECK_EVERY_S:
                    checked = time.monotonic()
                    stop = await self._stop_reason()
                    if stop:
                        return stop
                await self._submit()
                await self._collect()
            return "done"
        finally:
            for task in self.pending:
                task.cancel()

    async def cancel_jobs(self) -> None:
        """Ask the fleet to stop every job of this batch that has no answer yet, wherever it was submitted."""
        answered = await self.store.answered(self.batch.id)
        for custom_id, job_id in (await self.store.jobs(self.batch.id)).items():
            if custom_id not in answered:
                with contextlib.suppress(KvgateError):
                    await self.client.cancel(job_id)

    async def _stop_reason(self) -> str | None:
        status, expires_at = await self.store.status(self.batch.id)
        if status != "in_progress":
            return status or "gone"
        return "expired" if time.time() >= expires_at else None

    async def _submit(self) -> None:
        room = self.window - len(self.pending)
        if room <= 0 or not self.todo:
            return
        chunk = [self.todo.popleft() for _ in range(min(room, len(self.todo)))]
        try:
            handles = await self.client.submit_many([{**r.submit_args, "tenant": self.batch.tenant} for r in chunk],
                                                    chunk_size=self.chunk)
        except PartiallySubmitted as e:
            handles = e.handles
        except (Backpressure, KvgateError) as e:  # the queue is full or Redis refuses: keep what we have, retry
            log.info("batch %s: submit deferred: %s", self.batch.id, e)
            self.todo.extendleft(reversed(chunk))
            if not self.pending:
                await asyncio.sleep(RETRY_S)
            return
        self.todo.extendleft(reversed(chunk[len(handles):]))  # none, unless the SDK returned fewer handles
        await self.store.remember_jobs(self.batch.id, {r.custom_id: h.job_id for r, h in zip(chunk, handles)})
        for req, handle in zip(chunk, handles):
            self.pending[asyncio.ensure_future(handle.result())] = (req, handle.job_id)

    async def _collect(self) -> None:
        if not self.pending:
            return
        done, _ = await asyncio.wait(self.pending, timeout=CHECK_EVERY_S, return_when=asyncio.FIRST_COMPLETED)
        answers = []
        for task in done:
            req, job_id = self.pending.pop(task)
            try:
                result = task.result()
            except JobLost:  # Redis lost it: the same idempotency key enqueues it anew
                self.todo.append(req)
                continue
            row = answer_line(req, result, result.model or await self._served_by(result.worker))
            answers.append((req.custom_id, row, is_success(row)))
        if answers:
            await self.store.record_many(self.batch.id, answers)

    async def _served_by(self, worker_id: str | None) -> str | None:
        """The model the worker's heartbeat names (results carry only the worker id), as `kvgate batch` does."""
        if not worker_id:
            return None
        if worker_id not in self.models:
            raw = await self.client.redis.hget(self.client.keys.worker(worker_id), "model")
            self.models[worker_id] = raw.decode() if isinstance(raw, bytes) else raw
        return self.models[worker_id]
