"""JobHandle: one submitted job, as the Client sees it; HandleBase and StreamCursor are what AsyncJobHandle shares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from .errors import JobLost, ResultTimeout
from .job_status import JobStatus
from .mailbox import Mailbox
from .result import Result
from .stream import StreamItem, closing_items


class Deadlines(Protocol):
    """The clock a handle reads its timeouts on (ClientBase's): both clients share it."""

    def _deadline(self, timeout: float | None) -> float | None: ...

    def _remaining(self, deadline: float | None) -> float | None: ...


class HandleClient(Deadlines, Protocol):
    """What a JobHandle asks of the Client that made it: the seam that keeps client.py above handle.py."""

    def status(self, job_id: str) -> JobStatus: ...

    def cancel(self, job_id: str) -> None: ...

    def _wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool: ...


class HandleBase:
    __slots__ = ("job_id", "_client", "_box")

    def __init__(self, client, box: Mailbox):
        self.job_id = box.job_id
        self._client, self._box = client, box

    def __repr__(self) -> str:
        return f"{type(self).__name__}(job_id={self.job_id!r}, done={self.done()})"

    def done(self) -> bool:
        return self._box.final is not None


@dataclass(slots=True)
class StreamCursor:
    """What `stream()` yields next from a job's mailbox, without waiting: the thread's and the task's iterators wait
    until `ready`, then yield `take()`, until `ended`; `finish` then raises JobLost if the job was lost."""

    box: Mailbox
    seen: int = 0
    ended: bool = False

    def ready(self) -> bool:
        return len(self.box.items) > self.seen or self.box.settled

    def take(self) -> list[StreamItem]:
        box = self.box
        fresh = box.items[self.seen:]
        self.seen += len(fresh)
        if box.settled and self.seen == len(box.items):
            self.ended = True
            if box.final is not None:
                fresh = [*fresh, *closing_items(box.items, box.final)]
        return fresh

    def finish(self) -> None:
        if self.box.final is None:
            raise JobLost(self.box.job_id, self.box.lost)


class JobHandle(HandleBase):
    __slots__ = ()
    _client: HandleClient

    def status(self) -> JobStatus:
        """queued / running (on which worker) / finished / lost, read from Redis now."""
        return self._client.status(self.job_id)

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the final event; ResultTimeout (a TimeoutError) if none within `timeout` seconds, JobLost
        as soon as the job is found in no stream, pending nowhere and without a result."""
        if not self._client._wait_until(lambda: self._box.settled, timeout):
            raise ResultTimeout(self.job_id, timeout)
        return settled_result(self._box)

    def stream(self, timeout: float | None = None) -> Iterator[StreamItem]:
        """Deltas in order, ending at the final event. A `Restart` item means the job is being generated anew
        (it was redelivered, or the result differs from what was streamed): drop the text shown so far. The
        deltas' texts joined since the last Restart equal the result's text once the stream ends."""
        cursor, deadline = StreamCursor(self._box), self._client._deadline(timeout)
        while not cursor.ended:
            if not self._client._wait_until(cursor.ready, self._client._remaining(deadline)):
                raise ResultTimeout(self.job_id, timeout)
            yield from cursor.take()
        cursor.finish()

    def cancel(self) -> None:
        """Ask the fleet to stop this job; its final event then says 'cancelled' (with any partial text)."""
        self._client.cancel(self.job_id)


def settled_result(box: Mailbox) -> Result:
    if box.final is None:
        raise JobLost(box.job_id, box.lost)
    return Result.from_final(box.final, box.parse_as)
