"""The step's round trip: one pipeline per step carries the step's deltas and finals, what we tell the other
workers about our room, the refill reads for the room the step freed, and the cancellation poll when due. It
runs on the I/O thread while the engine computes the next step, and its replies are taken in before the next
one goes. What it brought back is handed to the loop as data (`Brought`)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import redis

from kvgate.worker.admission import Ticket
from kvgate.worker.affinity import Affinity
from kvgate.worker.cancellation import CancelFlags, Cancellation
from kvgate.worker.publisher import Publisher, Settled
from kvgate.worker.read_reply import Entry
from kvgate.worker.refill import Capacity, QueuedReads, Refill
from kvgate.worker.slots import Ignored, Outbox, PipelineSlots


@dataclass(slots=True)
class Sent:
    """A round trip on its way, with the slots the loop acts on once it settles."""

    replies: Future
    slots: PipelineSlots
    reads: QueuedReads | None  # the refill's reads
    polled: CancelFlags | None  # the cancel flags of the jobs we hold


@dataclass(slots=True)
class Brought:
    """What a settled round trip brought back: what the outbox did (accounted for even when a later command
    failed: then `error` is that failure, raised by the loop once the outbox is accounted for), the entries the
    reads took, and the jobs whose client cancelled them."""

    settled: Settled
    error: Exception | None = None
    entries: list[Entry] | None = None  # None: no read went
    flagged: list[Ticket] = field(default_factory=list)


class RoundTrip:
    def __init__(self, client: redis.Redis, publisher: Publisher, affinity: Affinity, refill: Refill,
                 cancellation: Cancellation) -> None:
        self.client, self.publisher, self.affinity = client, publisher, affinity
        self.refill, self.cancellation = refill, cancellation
        self.io = ThreadPoolExecutor(1, thread_name_prefix="kvgate-io")
        self.sent: Sent | None = None

    def send(self, capacity: Capacity, draining: bool, holding: list[Ticket] | None) -> bool:
        """Queue every party's commands and send them if there is anything to send; `holding`: the jobs whose cancel
        flags to poll (None: no poll due). Whether a round trip went."""
        pipe = self.client.pipeline(transaction=False)
        slots = PipelineSlots(Outbox(self.publisher, self.publisher.fill(pipe)))
        told = 0
        if self.affinity.enabled and self.affinity.lanes:
            told = slots.add(Ignored(self.affinity.tell(pipe, self.refill.has_room(capacity, draining)))).n
        spread = slots.add(Ignored(self.refill.queue_spread(pipe))).n
        request = self.refill.request(capacity, draining)
        reads = slots.add(self.refill.queue_reads(pipe, request)) if request else None
        polled = slots.add(self.cancellation.queue(pipe, holding)) if holding else None
        if not (self.publisher.filled or told or spread or reads or polled):
            return False
        self.sent = Sent(self.io.submit(self.publisher.round_trip, pipe), slots, reads, polled)
        return True

    def settle(self) -> Brought | None:
        """Wait for the round trip on its way, if any. A lost connection puts the outbox back and raises."""
        sent, self.sent = self.sent, None
        if sent is None:
            return None
        try:
            replies = sent.replies.result()
        except BaseException:
            self.publisher.requeue()
            raise
        brought = Brought(sent.slots.settle(replies))
        try:
            sent.slots.hand_out()
        except Exception as e:  # a later command's error: nobody acts on its replies
            brought.error = e
            return brought
        if sent.reads is not None:
            brought.entries = self.refill.settle(sent.reads)
        if sent.polled is not None:
            brought.flagged = sent.polled.flagged
        return brought

    def close(self) -> None:
        self.io.shutdown(wait=False)
