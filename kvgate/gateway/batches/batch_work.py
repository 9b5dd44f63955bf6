"""One batch's requests through the fleet: submit a window at a time, record each answer as it arrives.

Every line's job carries an idempotency key from the batch id and its custom_id (and, for an /v1/embeddings line
of several inputs, each of its jobs the input's place), so a replica resuming a batch that another one started
reattaches to the jobs already queued or finished instead of running them again; lines already answered are not
submitted at all. A line is recorded once, when every job it owns is final (`LineRun`).

The window counts jobs, per model (a line of more jobs than the window goes alone): lines for a model no worker
serves yet (an operator's `--model` waiting for its autoscaler) fill only that model's window, so they wait without
holding up the batch's other lines. A line for a model the gateway would answer 404 for is an error line at once.
Under quotas, a line is also charged to its tenant's batch ceiling before it is submitted (batch_quota.py): all the
tenant's batches share that ceiling, on every replica, where each has a window of its own.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.producer import AsyncClient, Backpressure, JobLost, KvgateError, PartiallySubmitted
from kvgate.openai.batch import BatchRequest, is_success, plan_line, request_lines, unknown_model_line
from kvgate.openai.batch_runs import LineRun, line_runs, submit_jobs

from ..errors import ApiError
from ..responses.batch_line import TRANSLATORS
from .batch_quota import BatchCeiling
from .batch_store import Batch, BatchStore
from .expires_after import expired
from .file_store import FileStore

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.5  # how often a running batch looks for a cancel or its expiry
RETRY_S = 1.0  # wait after a refused submit (backpressure, Redis refusing writes)
SUBMIT_CHUNK = 32  # the SDK checks the backlog before each chunk, so a batch stops at --max-backlog


class ModelCheck(Protocol):
    async def check(self, model: str) -> None:
        """ApiError (404 model_not_found) for a model the gateway would refuse: the gateway's LiveModels."""


@dataclass(slots=True)
class Work:
    """The state of one batch's run in this replica."""

    batch: Batch
    client: AsyncClient
    store: BatchStore
    window: int  # per model
    priority: str
    chunk: int = SUBMIT_CHUNK  # at most max_backlog, so one chunk cannot overshoot it
    known: ModelCheck | None = None  # None: every model is taken (lines wait for a worker)
    files: FileStore | None = None  # where the input lives; None: its deletion is not watched
    ceiling: BatchCeiling | None = None  # its tenant's batch ceiling; None: no quotas, lines are not charged
    todo: dict[str, deque[BatchRequest]] = field(default_factory=dict)  # by the line's model ("" for none)
    pending: dict[asyncio.Task, LineRun] = field(default_factory=dict)  # each resolves to the line's results
    models: dict[str, str | None] = field(default_factory=dict)
    refused: dict[str, str | None] = field(default_factory=dict)  # model -> why the gateway refuses it, or None
    expired: bool = False  # a worker answered a job "expired": the window passed before it started

    async def plan(self, data: bytes) -> None:
        """Queue the lines not yet answered; lines that fail on their own are answered with their error now."""
        b, answered = self.batch, await self.store.answered(self.batch.id)
        keys, client_id = self.client.keys, self.client.client_id
        # in a thread: validating tens of thousands of lines would hold up every other request of this gateway;
        # /v1/responses lines are read by the Responses API's own parser (TRANSLATORS)
        lines = await asyncio.to_thread(lambda: [plan_line(n, raw, b.id, self.priority, keys, client_id, TRANSLATORS)
                                                 for n, raw in request_lines(data)])
        rejected = []
        for planned in lines:
            if not isinstance(planned, BatchRequest):
                if planned["custom_id"] not in answered:
                    rejected.append((planned["custom_id"], planned, False))
            elif planned.custom_id not in answered:
                refusal = await self._refusal(planned.jobs[0].get("model"))
                if refusal is not None:
                    rejected.append((planned.custom_id, unknown_model_line(planned, refusal, b.id), False))
                else:
                    self.todo.setdefault(planned.model, deque()).append(planned)
        if rejected:
            await self.store.record_many(b.id, rejected)
        if self.ceiling is not None:
            await asyncio.to_thread(self.ceiling.estimate, [req for todo in self.todo.values() for req in todo])

    async def _refusal(self, model: str | None) -> str | None:
        """Why the gateway would answer 404 for the model (asked once per model), or None; a line without a model
        goes to whatever the fleet serves as its default."""
        if not model or self.known is None:
            return None
        if model not in self.refused:
            try:
                await self.known.check(model)
                self.refused[model] = None
            except ApiError as e:
                self.refused[model] = e.message
        return self.refused[model]

    async def run(self) -> str:
        """Until every line is answered ('done'; 'expired' where a line's job expired), or the batch is cancelled,
        past its window or its input file was deleted (that status, 'input_deleted')."""
        checked = 0.0
        try:
            while any(self.todo.values()) or self.pending:
                if time.monotonic() - checked > CHECK_EVERY_S:
                    checked = time.monotonic()
                    stop = await self._stop_reason()
                    if stop:
                        return stop
                if self.ceiling is not None:
                    await self.ceiling.renew()
                await self._submit()
                await self._collect()
            # the worker expires a queued job at the window's end, maybe before this loop looks: the batch expired
            return "expired" if self.expired else "done"
        finally:
            for task in self.pending:
                task.cancel()
            if self.ceiling is not None:  # Redis away: the lines' leases lapse instead
                with contextlib.suppress(Exception):
                    await self.ceiling.end()

    async def cancel_jobs(self) -> None:
        """Ask the fleet to stop every job of this batch that has no answer yet, wherever it was submitted."""
        answered = await self.store.answered(self.batch.id)
        for custom_id, job_ids in (await self.store.jobs(self.batch.id)).items():
            if custom_id not in answered:
                for job_id in job_ids:  # every job the line owns
                    with contextlib.suppress(KvgateError):
                        await self.client.cancel(job_id)

    async def _stop_reason(self) -> str | None:
        status, expires_at, now = await self.store.status(self.batch.id)  # now: the Redis server's clock
        if status != "in_progress":
            return status or "gone"
        if now >= expires_at:
            return "expired"
        if self.files is not None:
            source = await asyncio.to_thread(self.files.get, self.batch.input_file_id)
            if source is None or expired(source.expires_at, now):  # an input past its expires_after is as deleted
                return "input_deleted"
        return None

    def _take(self) -> list[BatchRequest]:
        """The next lines to submit: each model's, while their jobs fit its room in the window; a line of more jobs
        than the window goes alone, once none of its model's are in flight."""
        in_flight = Counter()
        for run in self.pending.values():
            in_flight[run.request.model] += len(run.job_ids)
        chunk: list[BatchRequest] = []
        for model, todo in self.todo.items():
            room = self.window - in_flight[model]
            while todo and (len(todo[0].jobs) <= room or room == self.window):
                room -= len(todo[0].jobs)
                chunk.append(todo.popleft())
        return chunk

    def _put_back(self, reqs: list[BatchRequest]) -> None:
        for req in reversed(reqs):
            self.todo[req.model].appendleft(req)

    async def _admit(self) -> list[BatchRequest]:
        """The lines to submit now: what the window takes, less what the tenant's batch ceiling has no room for."""
        chunk = self._take()
        if not chunk or self.ceiling is None:
            return chunk
        admitted = await self.ceiling.admit(chunk)
        kept = {id(req) for req in admitted}
        self._put_back([req for req in chunk if id(req) not in kept])
        if not admitted and not self.pending:  # the tenant's other batches hold the ceiling: look again later
            await asyncio.sleep(RETRY_S)
        return admitted

    async def _submit(self) -> None:
        chunk = await self._admit()
        if not chunk:
            return
        # every job carries what is left of the window as its time limit, measured by the worker from the moment
        # Redis takes it: one not started by expires_at is answered "expired" without running; one started runs on.
        # As a deadline on this machine's clock (the worker measures it from the job's own enqueued_at stamp), not as
        # ttl_s: a deadline is left out of the idempotency digest, so a resumed batch's resubmission reattaches
        _, expires_at, now = await self.store.status(self.batch.id)
        if now >= expires_at:  # the next look at the batch expires it; until then, no spinning on Redis
            self._put_back(chunk)
            await self._unsent(chunk)
            if not self.pending:
                await asyncio.sleep(CHECK_EVERY_S)
            return
        try:  # quota=False: _admit charged the lines to the tenant's batch ceiling, not to its interactive quota
            handles = await self.client.submit_many(submit_jobs(chunk, tenant=self.batch.tenant,
                                                                deadline=time.time() + expires_at - now),
                                                    chunk_size=self.chunk, quota=False)
        except PartiallySubmitted as e:
            handles = e.handles
        except (Backpressure, KvgateError) as e:  # the queue is full or Redis refuses: keep what we have, retry
            log.info("batch %s: submit deferred: %s", self.batch.id, e)
            self._put_back(chunk)
            await self._unsent(chunk)
            if not self.pending:
                await asyncio.sleep(RETRY_S)
            return
        runs = line_runs(chunk, [h.job_id for h in handles])
        # a line cut short is remembered too (a cancel reaches the jobs it has), and resubmitted whole: its keys
        # reattach the jobs already queued
        await self.store.remember_jobs(self.batch.id, {run.request.custom_id: run.job_ids for run in runs})
        submitted = [run for run in runs if run.submitted]
        if self.ceiling is not None:
            self.ceiling.sent([run.request.custom_id for run in runs])  # a line cut short too: jobs of it are queued
        self._put_back(chunk[len(submitted):])  # none, unless the SDK returned fewer handles
        await self._unsent(chunk[len(runs):])
        by_id = {h.job_id: h for h in handles}
        for run in submitted:
            self.pending[asyncio.ensure_future(asyncio.gather(*(by_id[j].result() for j in run.job_ids)))] = run

    async def _collect(self) -> None:
        if not self.pending:
            return
        done, _ = await asyncio.wait(self.pending, timeout=CHECK_EVERY_S, return_when=asyncio.FIRST_COMPLETED)
        answers, used = [], {}
        for task in done:
            run = self.pending.pop(task)
            try:
                results = task.result()
            except JobLost:  # Redis lost one: the same idempotency keys enqueue it anew and reattach the others
                self.todo[run.request.model].append(run.request)
                continue
            for result in results:
                run.add(result)
            first = results[0]
            self.expired |= run.expired  # not started within the window: its line is as finalizing writes it
            row = run.answer(self.batch.id, first.model or await self._served_by(first.worker))
            answers.append((run.request.custom_id, row, is_success(row)))
            used[run.request.custom_id] = sum(r.usage.prompt_tokens + r.usage.completion_tokens for r in results)
        if answers:
            await self.store.record_many(self.batch.id, answers)
        if used and self.ceiling is not None:  # after the answers are kept: a crash between leaves a lease to lapse
            await self.ceiling.answered(used)

    async def _unsent(self, reqs: list[BatchRequest]) -> None:
        if reqs and self.ceiling is not None:
            await self.ceiling.unsent([req.custom_id for req in reqs])

    async def _served_by(self, worker_id: str | None) -> str | None:
        """The model the worker's heartbeat names (results carry only the worker id), as `kvgate batch` does."""
        if not worker_id:
            return None
        if worker_id not in self.models:
            raw = await self.client.redis.hget(self.client.keys.worker(worker_id), "model")
            self.models[worker_id] = raw.decode() if isinstance(raw, bytes) else raw
        return self.models[worker_id]
