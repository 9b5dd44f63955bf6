"""JobHandle: one submitted job, as the Client sees it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from .errors import ResultTimeout
from .mailbox import Mailbox, tail_delta
from .protocol import Delta
from .result import Result

if TYPE_CHECKING:
    from .client import Client


class JobHandle:
    __slots__ = ("job_id", "_client", "_box")

    def __init__(self, client: "Client", box: Mailbox):
        self.job_id = box.job_id
        self._client, self._box = client, box

    def __repr__(self) -> str:
        return f"JobHandle(job_id={self.job_id!r}, done={self.done()})"

    def done(self) -> bool:
        return self._box.final is not None

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the final event; ResultTimeout (a TimeoutError) if none within `timeout` seconds."""
        if not self._client._wait_until(lambda: self._box.final is not None, timeout):
            raise ResultTimeout(self.job_id, timeout)
        return Result.from_final(self._box.final)

    def stream(self, timeout: float | None = None) -> Iterator[Delta]:
        """Token deltas in order, ending at the final event; their texts join to the result's text."""
        box, seen = self._box, 0
        deadline = self._client._deadline(timeout)
        while True:
            ready = self._client._wait_until(lambda: len(box.deltas) > seen or box.final is not None,
                                             self._client._remaining(deadline))
            if not ready:
                raise ResultTimeout(self.job_id, timeout)
            final, fresh = box.final, box.deltas[seen:]
            seen += len(fresh)
            yield from fresh
            if final is not None and seen == len(box.deltas):
                tail = tail_delta(box.deltas, final)
                if tail is not None:
                    yield tail
                return

    def cancel(self) -> None:
        """Ask the fleet to stop this job; its final event then says 'cancelled' (with any partial text)."""
        self._client.cancel(self.job_id)
