"""The read script's reply (worker/reader.py READ_LUA), taken apart in one place: named fields into entries."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvgate.producer.keys import as_text


def named(flat: list) -> dict[str, Any]:
    """A script reply of name, value pairs as a dict."""
    return {as_text(k): v for k, v in zip(flat[::2], flat[1::2])}


@dataclass(slots=True)
class StreamReply:
    """One stream's part of the read script's reply, by the names the script gives them."""

    stream: bytes
    new: list = field(default_factory=list)  # [id, fields] read new
    taken: list = field(default_factory=list)  # [id, fields or False, deliveries] taken over from a dead worker
    few: int = 0  # a tenant's stream: its jobs may make room for themselves (Entry.may_preempt)
    alone: int = 0  # a tenant's stream: its tenant was the only one backlogged in the band (Entry.alone)
    handed: list = field(default_factory=list)  # [id, fields or False, deliveries] handed back (worker/hand_back.py)

    def entries(self) -> list[Entry]:
        stream = as_text(self.stream)
        return ([Entry(stream, as_text(i), _pairs(f), n, handed_back=True) for i, f, n in self.handed]
                + [Entry(stream, as_text(i), _pairs(f), n) for i, f, n in self.taken]
                + [Entry(stream, as_text(i), _pairs(f), 1, bool(self.few), bool(self.alone)) for i, f in self.new])


@dataclass(slots=True)
class ReadReply:
    """The read script's whole reply, the one place it is taken apart."""

    streams: list[StreamReply]
    queued: dict[str, int]  # band stream -> its jobs still queued after the read

    @classmethod
    def of(cls, reply: list) -> ReadReply:
        fields = named(reply)
        flat = fields["queued"]
        return cls([StreamReply(**named(row)) for row in fields["streams"]],
                   {as_text(band): int(n) for band, n in zip(flat[::2], flat[1::2])})

    def entries(self) -> list[Entry]:
        return [e for row in self.streams for e in row.entries()]


class Entry(NamedTuple):
    """A job stream's entry as a read hands it over."""

    stream: str
    entry_id: str
    fields: dict | None  # None: gone (deleted or trimmed while pending)
    deliveries: int
    may_preempt: bool = False  # its tenant had few jobs waiting, so it may make room (Occupancy.makes_room)
    alone: bool = False  # its tenant was the only one backlogged in its band: its read's charge stands
    handed_back: bool = False  # taken from the hand-back index: read (and charged) before, by another look


def _pairs(flat: list | None) -> dict | None:
    return dict(zip(flat[::2], flat[1::2])) if flat else None
