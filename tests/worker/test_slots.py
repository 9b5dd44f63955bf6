"""A shared pipeline's replies go to whoever queued the commands, in order (worker/slots.py): each slot takes its
own, the outbox's first; an error among the others is raised only once the outbox is accounted for, and before
any other slot acts on its replies."""
from __future__ import annotations

import pytest
import redis

from kvgate.worker.cancellation import CancelFlags
from kvgate.worker.reader import ReadSlot
from kvgate.worker.slots import Ignored, Outbox, PipelineSlots


class Outboxed:
    """Stands for the Publisher: what `settle` got is what the round trip sent for the outbox."""

    def settle(self, replies: list) -> list:
        return ["settled", *replies]


def test_each_slot_takes_the_replies_of_its_own_commands_in_the_order_they_were_queued():
    slots = PipelineSlots(Outbox(Outboxed(), 2))
    slots.add(Ignored(1))
    read = slots.add(ReadSlot())
    flags = slots.add(CancelFlags(["a", "b", "c"], 2))
    stream_reply = [b"streams", [[b"stream", b"s", b"new", [[b"1-0", [b"job", b"x"]]], b"taken", []]],
                    b"queued", []]  # the read script's named fields
    assert slots.settle([1, 1, "told", stream_reply, [None, b"1"], [None]]) == ["settled", 1, 1]
    slots.hand_out()
    assert [(e.stream, e.entry_id, e.fields, e.deliveries) for e in read.entries] == [("s", "1-0", {b"job": b"x"}, 1)]
    assert flags.flagged == ["b"]


def test_an_error_after_the_outbox_is_raised_once_the_outbox_is_settled_and_before_any_slot_acts():
    slots = PipelineSlots(Outbox(Outboxed(), 1))
    read = slots.add(ReadSlot())
    assert slots.settle([1, redis.ResponseError("OOM")]) == ["settled", 1]
    with pytest.raises(redis.ResponseError, match="OOM"):
        slots.hand_out()
    assert read.entries == []
