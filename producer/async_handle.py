"""AsyncJobHandle: one submitted job, as the AsyncClient sees it (await result, async for stream)."""
from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator

from .errors import JobLost, ResultTimeout
from .handle import settled_result
from .job_status import JobStatus
from .mailbox import Mailbox
from .result import Result
from .stream import StreamItem, closing_items

if TYPE_CHECKING:
    from .async_client import AsyncClient


class AsyncJobHandle:
    __slots__ = ("job_id", "_client", "_box")

    def __init__(self, client: "AsyncClient", box: Mailbox):
        self.job_id = box.job_id
        self._client, self._box = client, box

    def __repr__(self) -> str:
        return f"AsyncJobHandle(job_id={self.job_id!r}, done={self.done()})"

    def done(self) -> bool:
        return self._box.final is not None

    async def status(self) -> JobStatus:
        return await self._client.status(self.job_id)

    async def result(self, timeout: float | None = None) -> Result:
        """As JobHandle.result: ResultTimeout after `timeout`, JobLost once the job is found gone."""
        if not await self._client._wait_until(lambda: self._box.settled, timeout):
            raise ResultTimeout(self.job_id, timeout)
        return settled_result(self._box)

    async def stream(self, timeout: float | None = None) -> AsyncIterator[StreamItem]:
        """As JobHandle.stream: deltas and Restart items; the text since the last Restart is the result's."""
        box, seen = self._box, 0
        deadline = self._client._deadline(timeout)
        while True:
            ready = await self._client._wait_until(lambda: len(box.items) > seen or box.settled,
                                                   self._client._remaining(deadline))
            if not ready:
                raise ResultTimeout(self.job_id, timeout)
            fresh = box.items[seen:]
            seen += len(fresh)
            for item in fresh:
                yield item
            if box.settled and seen == len(box.items):
                if box.final is None:
                    raise JobLost(self.job_id, box.lost)
                for item in closing_items(box.items, box.final):
                    yield item
                return

    async def cancel(self) -> None:
        await self._client.cancel(self.job_id)
