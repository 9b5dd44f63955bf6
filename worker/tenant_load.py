"""What one worker does for each tenant, as its heartbeat publishes it: jobs running now, tokens served and the queue
wait of the jobs it admitted over the last minute. No I/O: the worker feeds it, the heartbeat writes `snapshot()`.

Bounded whatever tenants producers invent: a window's slot names at most `limit` tenants (more are counted under
OTHER_TENANTS), and a snapshot names the TOP_TENANTS busiest, the rest summed under OTHER_TENANTS, the rule every
per-tenant view follows (limits.TOP_TENANTS). Waits are counts on QUEUE_WAIT_BUCKETS, so readers can sum workers'
counts and take percentiles of the fleet (producer/queue_stats.py); a mean or a worker's own p99 would not add up.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from kvgate.producer.keys import QUEUE_WAIT_BUCKETS, TENANT_WINDOW_S
from kvgate.producer.limits import DEFAULT_TENANT, OTHER_TENANTS, TOP_TENANTS, top_and_rest

WINDOW_S = TENANT_WINDOW_S  # what `tokens` and the waits cover
SLOT_S = 10.0  # the window moves in steps of this
SLOT_TENANTS = 256  # tenants one slot names


def empty_row() -> list[int]:
    """[running, tokens, one count per wait bucket, the last past every edge]."""
    return [0] * (3 + len(QUEUE_WAIT_BUCKETS))


def add_rows(into: list[int], row: list[int]) -> None:
    for i, v in enumerate(row):
        into[i] += v


@dataclass(slots=True)
class TenantLoad:
    limit: int = SLOT_TENANTS
    slots: deque = field(default_factory=deque)  # (slot number, {tenant: row without the running count}), oldest first

    def _row(self, tenant: str | None, now: float) -> list[int]:
        number = int(now // SLOT_S)
        if not self.slots or self.slots[-1][0] != number:
            self.slots.append((number, {}))
        while self.slots and self.slots[0][0] <= number - WINDOW_S / SLOT_S:
            self.slots.popleft()
        rows = self.slots[-1][1]
        name = tenant or DEFAULT_TENANT
        if name not in rows and len(rows) >= self.limit:
            name = OTHER_TENANTS
        return rows.setdefault(name, empty_row())

    def admitted(self, tenant: str | None, wait_s: float, now: float) -> None:
        """A job started in the engine after waiting `wait_s` (on the server's clock: enqueue to admission)."""
        self._row(tenant, now)[2 + bisect.bisect_left(QUEUE_WAIT_BUCKETS, max(0.0, wait_s))] += 1

    def finished(self, tenant: str | None, tokens: int, now: float) -> None:
        """A job answered: its prompt plus generated tokens, as fair share counts a tenant's service."""
        self._row(tenant, now)[1] += max(0, tokens)

    def snapshot(self, running: Iterable[str | None], now: float, top: int = TOP_TENANTS) -> dict[str, list[int]]:
        """Per tenant [running, tokens, wait counts...] over the window: the `top` busiest (running jobs, then
        tokens, then jobs admitted), every other tenant summed under OTHER_TENANTS."""
        rows: dict[str, list[int]] = {}
        for number, slot in self.slots:
            if number > (now - WINDOW_S) // SLOT_S:
                for tenant, row in slot.items():
                    add_rows(rows.setdefault(tenant, empty_row()), row)
        for tenant in running:
            rows.setdefault(tenant or DEFAULT_TENANT, empty_row())[0] += 1
        return fold(rows, top)


def fold(rows: dict[str, list[int]], top: int = TOP_TENANTS) -> dict[str, list[int]]:
    """The `top` busiest rows by name, the rest (OTHER_TENANTS' own included) summed under OTHER_TENANTS."""
    named, others = top_and_rest((t for t in rows if t != OTHER_TENANTS),
                                 lambda t: (-rows[t][0], -rows[t][1], -sum(rows[t][2:]), t), top)
    out = {t: rows[t] for t in named}
    rest = empty_row()
    for t in others + ([OTHER_TENANTS] if OTHER_TENANTS in rows else []):
        add_rows(rest, rows[t])
    if any(rest):
        out[OTHER_TENANTS] = rest
    return out
