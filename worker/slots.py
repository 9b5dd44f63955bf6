"""One pipeline shared by several parties: each party queues its commands and gets back a slot that takes its
own replies, in the order it queued them. Settling walks the slots; nobody counts offsets into another party's
replies.

The outbox's slot comes first and settles before anything else is looked at: what went out is accounted for
even when a later command failed (the next round trip must not send it again)."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Iterator, Protocol

if TYPE_CHECKING:
    from kvgate.worker.affinity import Affinity
    from kvgate.worker.publisher import Publisher, Settled


class Slot(Protocol):
    def take(self, replies: Iterator) -> None:
        """Consume exactly the replies of the commands this slot's party queued."""


@dataclass(slots=True)
class Ignored:
    """Commands whose replies say nothing we act on (an error among them still fails the round trip)."""

    n: int

    def take(self, replies: Iterator) -> None:
        for _ in islice(replies, self.n):
            pass


@dataclass(slots=True)
class FullOwners:
    """The reads of who is full now (Affinity.look), for the next read plan."""

    affinity: Affinity
    n: int

    def take(self, replies: Iterator) -> None:
        if self.n:
            self.affinity.seen(list(islice(replies, self.n)))


@dataclass(slots=True)
class Outbox:
    """The publisher's deltas and finals (Publisher.fill): what they did, once settled."""

    publisher: Publisher
    n: int
    settled: Settled | None = None

    def take(self, replies: Iterator) -> None:
        self.settled = self.publisher.settle(list(islice(replies, self.n)))


@dataclass(slots=True)
class PipelineSlots:
    """The slots of what one pipeline carries: the outbox's first, then the others in the order they queued."""

    outbox: Outbox
    slots: list[Slot] = field(default_factory=list)
    rest: list = field(default_factory=list)  # the replies after the outbox's, once settled

    def add(self, slot):
        self.slots.append(slot)
        return slot

    def settle(self, replies: list) -> Settled:
        """What the outbox's part of the replies did; the others wait for `hand_out`."""
        rest = iter(replies)
        self.outbox.take(rest)
        self.rest = list(rest)
        return self.outbox.settled

    def hand_out(self) -> None:
        """Hand every other slot its replies, unless one of them failed: then raise it, before anyone acts."""
        error = next((r for r in self.rest if isinstance(r, Exception)), None)
        if error is not None:
            raise error
        rest = iter(self.rest)
        for slot in self.slots:
            slot.take(rest)
