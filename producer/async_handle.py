"""AsyncJobHandle: one submitted job, as the AsyncClient sees it (await result, async for stream)."""
from __future__ import annotations

from typing import AsyncIterator, Callable, Protocol

from .errors import ResultTimeout
from .handle import Deadlines, HandleBase, StreamCursor, settled_result
from .job_status import JobStatus
from .result import Result
from .stream import StreamItem


class AsyncHandleClient(Deadlines, Protocol):
    """What an AsyncJobHandle asks of the AsyncClient that made it: the seam that keeps async_client.py above this
    module."""

    async def status(self, job_id: str) -> JobStatus: ...

    async def cancel(self, job_id: str) -> None: ...

    async def _wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool: ...


class AsyncJobHandle(HandleBase):
    __slots__ = ()
    _client: AsyncHandleClient

    async def status(self) -> JobStatus:
        return await self._client.status(self.job_id)

    async def result(self, timeout: float | None = None) -> Result:
        """As JobHandle.result: ResultTimeout after `timeout`, JobLost once the job is found gone."""
        if not await self._client._wait_until(lambda: self._box.settled, timeout):
            raise ResultTimeout(self.job_id, timeout)
        return settled_result(self._box)

    async def stream(self, timeout: float | None = None) -> AsyncIterator[StreamItem]:
        """As JobHandle.stream: deltas and Restart items; the text since the last Restart is the result's."""
        cursor, deadline = StreamCursor(self._box), self._client._deadline(timeout)
        while not cursor.ended:
            if not await self._client._wait_until(cursor.ready, self._client._remaining(deadline)):
                raise ResultTimeout(self.job_id, timeout)
            for item in cursor.take():
                yield item
        cursor.finish()

    async def cancel(self) -> None:
        await self._client.cancel(self.job_id)
