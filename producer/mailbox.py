"""Routing of reply events to job handles, with no I/O, shared by the thread and asyncio readers.

A Mailbox holds what arrived for one job: its deltas in order and its final event. The router keeps
mailboxes weakly (a dropped handle frees its mailbox) and keeps events for jobs that have no mailbox
yet, so a handle created after its events arrived still sees them.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable

from .protocol import Delta, Final
from .stream import AttemptFilter, StreamItem

MAX_ORPHAN_JOBS = 10_000


class Mailbox:
    __slots__ = ("job_id", "foreign", "created", "items", "attempts", "final", "listeners", "entry", "lost",
                 "parse_as", "__weakref__")

    def __init__(self, job_id: str, foreign: bool):
        self.job_id = job_id
        self.foreign = foreign  # owned by another client: its events go elsewhere, so poll the result key
        self.created = time.monotonic()
        self.items: list[StreamItem] = []  # deltas and restarts, in the order stream() yields them
        self.attempts = AttemptFilter()
        self.final: Final | None = None
        self.listeners: list[Callable[[Mailbox], None]] = []  # called once, when the final arrives
        self.entry: tuple[str, str] | None = None  # (job stream, entry id) when known: lets the reader spot a lost job
        self.lost: str | None = None  # why the job can no longer finish, once the reader found it gone
        self.parse_as = None  # a pydantic model class: the result's text is validated into Result.parsed

    def put(self, event: Delta | Final) -> bool:
        """Keep an event; False when it adds nothing (a duplicate, a superseded attempt, anything after the final)."""
        if self.final is not None:
            return False
        if isinstance(event, Final):
            self.final = event
            return True
        added = self.attempts.admit(event)
        if not added:
            return False
        self.items += added
        return True

    @property
    def settled(self) -> bool:
        return self.final is not None or self.lost is not None


class ReplyRouter:
    def __init__(self, on_change: Callable[[], None], on_final: Callable[[str, Final | None], None] | None = None):
        """on_final(job_id, final) for every final event routed, a job's mailbox or not (None: the job was lost)."""
        self._boxes: weakref.WeakValueDictionary[str, Mailbox] = weakref.WeakValueDictionary()
        self._orphans: OrderedDict[str, list[Delta | Final]] = OrderedDict()
        self._foreign: set[str] = set()  # unfinished jobs of other clients, whose result keys the reader polls
        self._lock = threading.Lock()
        self._on_change = on_change
        self._on_final = on_final

    def mailbox(self, job_id: str, foreign: bool = False, entry: tuple[str, str] | None = None,
                parse_as: Any = None) -> Mailbox:
        """The job's mailbox, made on first use; `parse_as`: the pydantic class its answer is validated into."""
        with self._lock:
            box = self._boxes.get(job_id)
            if box is None:
                box = self._boxes[job_id] = Mailbox(job_id, foreign)
                for event in self._orphans.pop(job_id, []):
                    box.put(event)
            box.entry = box.entry or entry
            box.parse_as = box.parse_as or parse_as
            box.foreign = box.foreign and foreign
            if box.foreign and box.final is None:
                self._foreign.add(job_id)
            return box

    def has_foreign(self) -> bool:
        return bool(self._foreign)

    def route(self, events: list[Delta | Final]) -> None:
        changed, finished = False, []
        if self._on_final is not None:
            for event in events:
                if isinstance(event, Final):
                    self._on_final(event.job_id, event)
        with self._lock:
            for event in events:
                box = self._boxes.get(event.job_id)
                if box is None:
                    self._keep_orphan(event)
                elif box.put(event):
                    changed = True
                    if box.final is not None:
                        finished.append(box)
                        self._foreign.discard(box.job_id)
        for box in finished:
            for listener in box.listeners:
                listener(box)
        if changed:
            self._on_change()

    def when_final(self, box: Mailbox, listener: Callable[[Mailbox], None]) -> None:
        """Call listener(box) once the final is there (or the job is known lost): now if it already is."""
        with self._lock:
            if not box.settled:
                box.listeners.append(listener)
                return
        listener(box)

    def mark_lost(self, job_id: str, reason: str) -> None:
        """The job is in no stream, pending nowhere and has no result: it will never finish."""
        if self._on_final is not None:
            self._on_final(job_id, None)
        with self._lock:
            box = self._boxes.get(job_id)
            if box is None or box.settled:
                return
            box.lost = reason
            self._foreign.discard(job_id)
        for listener in box.listeners:
            listener(box)
        self._on_change()

    def entry(self, job_id: str) -> tuple[str, str] | None:
        with self._lock:
            box = self._boxes.get(job_id)
            return None if box is None else box.entry

    def entries(self, job_ids: list[str]) -> list[tuple[str, str, str]]:
        """(job_id, stream, entry id) of those jobs whose entry is known and that have not settled."""
        with self._lock:
            boxes = [self._boxes.get(j) for j in job_ids]
        return [(b.job_id, *b.entry) for b in boxes if b is not None and b.entry is not None and not b.settled]

    def _keep_orphan(self, event: Delta | Final) -> None:
        self._orphans.setdefault(event.job_id, []).append(event)
        self._orphans.move_to_end(event.job_id)
        while len(self._orphans) > MAX_ORPHAN_JOBS:
            self._orphans.popitem(last=False)

    def unfinished(self, foreign: bool, older_than_s: float = 0.0, limit: int = 1000) -> list[str]:
        """Job ids still waiting for a final event: the candidates for a result-key poll."""
        cutoff = time.monotonic() - older_than_s
        with self._lock:
            if foreign:
                self._foreign &= set(self._boxes.keys())  # handles dropped meanwhile
                boxes = [self._boxes[j] for j in self._foreign]
            else:
                boxes = list(self._boxes.values())
        return [b.job_id for b in boxes
                if not b.settled and b.foreign == foreign and b.created <= cutoff][:limit]

    def __len__(self) -> int:
        return len(self._boxes)
