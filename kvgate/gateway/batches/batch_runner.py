"""The task in each gateway that drives batches: validating -> in_progress -> finalizing -> completed.

Every poll it looks at the batches not yet final and takes the lease of any that nobody drives (SET NX PX,
renewed at a third of its length). A replica that dies stops renewing, its leases lapse, and another replica
(or the same one restarted) resumes the batch from what Redis holds: the lines already answered, and the jobs
already submitted, reattached through their idempotency keys.

A batch accounts for every line of its input, whatever happens: validation keeps the custom_ids in order, and a
batch that ends cancelled or expired writes an error line for each one never answered. A batch expires once the
Redis server's clock passes its expires_at (created_at + completion_window, on that clock; every time a batch shows
is the server's): the lines answered by then are its output, every other line a batch_expired error line, as
OpenAI's. Deleting the input file cancels the batch (its outstanding jobs too), noticed by the replica driving it
or by the next one to resume it.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets

from kvgate.producer import AsyncClient
from kvgate.openai.batch import UNRUN, custom_id_of, is_success, request_lines, unrun_line

from .batch_input import check_input
from .batch_quota import BatchQuota
from .batch_store import Batch, BatchStore
from .batch_work import SUBMIT_CHUNK, ModelCheck, Work
from .expires_after import expired
from .file_store import FileStore

log = logging.getLogger(__name__)


def result_file_id(batch_id: str, kind: str) -> str:
    """Fixed per batch, so a finalization redone after a crash replaces its files instead of adding copies."""
    return "file-" + hashlib.sha256(f"{batch_id}\n{kind}".encode()).hexdigest()[:24]


class BatchRunner:
    def __init__(self, client: AsyncClient, store: BatchStore, files: FileStore, *, window: int, priority: str,
                 lease_s: float, poll_s: float, max_backlog: int | None = None, models: ModelCheck | None = None):
        """`models`: the gateway's models check; a line for a model it refuses is an error line, not a job."""
        self.client, self.store, self.files, self.models = client, store, files, models
        self.chunk = min(SUBMIT_CHUNK, max_backlog or SUBMIT_CHUNK)
        self.window, self.priority, self.lease_s, self.poll_s = window, priority, lease_s, poll_s
        # the window bounds one batch; this, all of a tenant's batches together (its quotas' batch ceilings)
        self.quota = BatchQuota(client.redis, client.keys, client.quotas, lease_s)
        self.token = secrets.token_hex(8)
        self.driving: dict[str, asyncio.Task] = {}
        self._loop: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._loop = asyncio.create_task(self._watch(), name="kvgate-batches")

    async def stop(self) -> None:
        """Stop driving; the leases are released, so another replica may resume at once."""
        tasks = [t for t in [self._loop, *self.driving.values()] if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    def wake(self) -> None:
        """A batch was created here: look now rather than at the next poll."""
        self._wake.set()

    async def _watch(self) -> None:
        while True:
            try:
                for batch_id in await self.store.active():
                    if batch_id not in self.driving and await self.store.acquire(batch_id, self.token, self.lease_s):
                        task = asyncio.create_task(self._drive(batch_id), name=f"kvgate-{batch_id}")
                        self.driving[batch_id] = task
                        task.add_done_callback(lambda _, b=batch_id: self.driving.pop(b, None))
            except Exception as e:  # Redis away for a moment: the next poll tries again
                log.warning("batch runner: %r", e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()

    async def _drive(self, batch_id: str) -> None:
        work = asyncio.create_task(self._advance(batch_id))
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=self.lease_s / 3)
                if not work.done() and not await self.store.renew(batch_id, self.token, self.lease_s):
                    log.warning("batch %s: lease lost; another replica drives it now", batch_id)
                    work.cancel()
            work.result()
        except asyncio.CancelledError:
            work.cancel()
            raise
        except Exception:
            log.exception("batch %s: driving failed; it is retried at the next poll", batch_id)
        finally:
            with contextlib.suppress(Exception):
                await self.store.release(batch_id, self.token)

    async def _advance(self, batch_id: str) -> None:
        """Move the batch along until it is final; each step re-reads the status a cancel may have changed."""
        while (b := await self.store.get(batch_id)) is not None:
            if b.status == "validating":
                await self._validate(b)
            elif b.status == "in_progress":
                await self._process(b)
            elif b.status == "finalizing":
                await self._finalize(b, ("finalizing",), "completed", "completed_at")
            elif b.status == "cancelling":
                await self._work(b).cancel_jobs()
                await self._finalize(b, ("cancelling",), "cancelled", "cancelled_at")
            else:
                return

    def _work(self, b: Batch) -> Work:
        return Work(b, self.client, self.store, self.window, self.priority, self.chunk, self.models, self.files,
                    ceiling=self.quota.of(b.tenant, b.id))

    async def _validate(self, b: Batch) -> None:
        data = await self._input(b)
        if data is None:
            checked = None
            errors = [{"code": "file_not_found", "message": f"input file {b.input_file_id} is gone", "param":
                       "input_file_id", "line": None}]
        else:  # in a thread: parsing tens of thousands of lines would hold up every other request of this gateway
            checked = await asyncio.to_thread(check_input, data, b.endpoint)
            errors = checked.errors
        if await self._past_window(b):
            await self._expire(b, ("validating",))
        elif errors:
            await self.store.transition(b.id, ("validating",), "failed", failed_at=await self.store.now(),
                                        errors={"object": "list", "data": errors})
        else:
            await self.store.keep_order(b.id, checked.custom_ids)
            await self.store.transition(b.id, ("validating",), "in_progress",
                                        in_progress_at=await self.store.now(), total=len(checked.custom_ids))

    async def _process(self, b: Batch) -> None:
        data = await self._input(b)
        if data is None:  # deleted while no replica drove the batch (a restart): that cancels it, as below
            await self._cancel_for_deleted_input(b)
            return
        work = self._work(b)
        await work.plan(data)
        outcome = await work.run()
        if outcome == "done" and await self._past_window(b) and await self._has_expired_line(b):
            outcome = "expired"  # a run before a restart saw jobs expire: the batch ends as its lines say
        if outcome == "done":
            await self.store.transition(b.id, ("in_progress",), "finalizing", finalizing_at=await self.store.now())
        elif outcome == "expired":  # its jobs are not cancelled: each carries the window as its deadline (batch_work)
            await self._expire(b, ("in_progress",))
        elif outcome == "input_deleted":
            await self._cancel_for_deleted_input(b)

    async def _cancel_for_deleted_input(self, b: Batch) -> None:
        """A batch whose input is deleted is cancelled, as a cancel request would: the loop then cancels its jobs
        and writes an error line for every line not answered."""
        log.info("batch %s: input file %s was deleted; cancelling the batch", b.id, b.input_file_id)
        await self.store.transition(b.id, ("in_progress",), "cancelling", cancelling_at=await self.store.now())

    async def _past_window(self, b: Batch) -> bool:
        _, expires_at, now = await self.store.status(b.id)
        return now >= expires_at

    async def _has_expired_line(self, b: Batch) -> bool:
        rows = (json.loads(row) for row in (await self.store.lines(b.id)).values())
        return any((row.get("error") or {}).get("code") == UNRUN["expired"][0] for row in rows)

    async def _expire(self, b: Batch, allowed: tuple[str, ...]) -> None:
        await self._finalize(b, allowed, "expired", "expired_at")

    async def _finalize(self, b: Batch, allowed: tuple[str, ...], status: str, stamp: str) -> None:
        """Write the output (answers) and error files in input order, then move to the final status. Every line is
        in one of them: a cancelled or expired batch's unanswered lines get an error line saying so, and the
        request counts are those of the files."""
        lines = await self.store.lines(b.id)
        order = await self._order(b, lines)
        unrun = "expired" if status == "expired" else "cancelled"
        rows = [lines.get(c) or json.dumps(unrun_line(b.id, c, unrun), ensure_ascii=False) for c in order]
        ok = [row for row in rows if is_success(json.loads(row))]
        bad = [row for row in rows if not is_success(json.loads(row))]
        output = await self._write(b, "output", ok)
        error = await self._write(b, "error", bad)
        stamps = {stamp: await self.store.now()}
        if await self.store.transition(b.id, allowed, status, output_file_id=output, error_file_id=error,
                                       total=len(rows), completed=len(ok), failed=len(bad), **stamps):
            await self.store.forget_work(b.id)

    async def _order(self, b: Batch, lines: dict[str, str]) -> list[str]:
        """Every custom_id of the input in order (kept at validation); then any answered line not among them."""
        order = await self.store.order(b.id)
        if order is None:  # validated before the order was kept, or never validated: the input, while it exists
            data = await self._input(b) or b""
            order = list(dict.fromkeys(c for c in (custom_id_of(raw) for _, raw in request_lines(data)) if c))
        seen = set(order)
        return order + sorted(c for c in lines if c not in seen)

    async def _write(self, b: Batch, kind: str, rows: list[str]) -> str | None:
        if not rows:
            return None
        data = ("\n".join(rows) + "\n").encode()
        now = await self.store.now()  # output_expires_after is anchored at the file's created_at, on this clock
        expires_at = None if b.output_expires_s is None else now + b.output_expires_s
        obj = await asyncio.to_thread(self.files.put, data, f"{b.id}_{kind}.jsonl", "batch_output",
                                      result_file_id(b.id, kind), tenant=b.tenant, created_at=now,
                                      expires_at=expires_at)
        return obj.id

    async def _input(self, b: Batch) -> bytes | None:
        """The input file's content; None once it is deleted or past its expires_after (as deleted)."""
        now = await self.store.now()

        def read() -> bytes | None:
            obj = self.files.get(b.input_file_id)
            if obj is None or expired(obj.expires_at, now):
                return None
            f = self.files.open(b.input_file_id)
            if f is None:
                return None
            with f:
                return f.read()

        return await asyncio.to_thread(read)
