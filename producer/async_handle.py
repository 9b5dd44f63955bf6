"""AsyncJobHandle: one submitted job, as the AsyncClient sees it (await result, async for stream)."""
from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator

from .errors import ResultTimeout
from .mailbox import Mailbox, tail_delta
from .protocol import Delta
from .result import Result

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

    async def result(self, timeout: float | None = None) -> Result:
        if not await self._client._wait_until(lambda: self._box.final is not None, timeout):
            raise ResultTimeout(self.job_id, timeout)
        return Result.from_final(self._box.final)

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Delta]:
        box, seen = self._box, 0
        deadline = self._client._deadline(timeout)
        while True:
            ready = await self._client._wait_until(lambda: len(box.deltas) > seen or box.final is not None,
                                                   self._client._remaining(deadline))
            if not ready:
                raise ResultTimeout(self.job_id, timeout)
            final, fresh = box.final, box.deltas[seen:]
            seen += len(fresh)
            for delta in fresh:
                yield delta
            if final is not None and seen == len(box.deltas):
                tail = tail_delta(box.deltas, final)
                if tail is not None:
                    yield tail
                return

    async def cancel(self) -> None:
        await self._client.cancel(self.job_id)
