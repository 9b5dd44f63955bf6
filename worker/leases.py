"""Leases on pending stream entries: renew our own, hand ours back on drain.

A pending entry's idle time is its lease. A live worker resets the idle time of its in-flight entries
(XCLAIM to itself with JUSTID, which does not count as a delivery) well inside the reclaim timeout, so a
long generation is never stolen; an entry idle past the timeout belongs to a dead worker and any worker
may take it over (reader.py: ahead of new entries, counting a delivery). A renewal that finds an entry no
longer ours tells the worker to stop that job: someone else runs or has finished it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from kvgate.producer.cluster import run_script
from kvgate.producer.keys import Keys, as_text
from kvgate.producer.redis_url import FAILOVER_ERRORS
from kvgate.worker.admission import Ticket

log = logging.getLogger("kvgate.worker")

HANDBACK_IDLE_MS = 10**12  # an entry this idle is past every worker's reclaim timeout: reclaimable at once
# Renew only what is still pending to us, atomically; return the ids that are not.
RENEW_OWN = """
local lost = {}
for i = 3, #ARGV do
  local row = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if row[1] and row[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""


@dataclass(slots=True)
class Leases:
    client: redis.Redis
    consumer: str
    script: object = None

    def __post_init__(self) -> None:
        self.script = self.client.register_script(RENEW_OWN)

    def renew(self, entries: dict[str, list[str]]) -> set[str]:
        """Reset the idle time of our in-flight entries; returns those no longer pending to us, as request keys
        (`stream|entry id`): another worker took them over after we stalled, or finished them.

        Only entries still pending to us, checked and claimed in one script: XCLAIM with min-idle 0 succeeds
        whoever holds an entry, so a separate check would leave a window in which an entry another worker
        reclaimed after we stalled is taken back, and both would run it."""
        streams = [(s, ids) for s, ids in entries.items() if ids]
        if not streams:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for stream, ids in streams:
            run_script(self.script, [stream], [Keys.GROUP, self.consumer, *ids], pipe)
        return {f"{stream}|{as_text(i)}" for (stream, _), lost in zip(streams, pipe.execute()) for i in lost}

    def count_delivery(self, stream: str, ids: list[str], held: list[str] = ()) -> list[int]:
        """The delivery counts of the entries a read of our own pending returned, that read included: Redis (6.2 and
        7) counts a history read of XREADGROUP as one more delivery, which is right for an entry we take up again
        (a restart under the same id: the count reaches max_deliveries even when each delivery killed the process
        before its decoding ended) and is undone for the `held` ones we still run (a rewind after a lost reply).
        JUSTID claims count none. Adding one more here counted each restart twice."""
        pipe = self.client.pipeline(transaction=False)
        for entry_id in [*ids, *held]:
            pipe.xpending_range(stream, Keys.GROUP, min=entry_id, max=entry_id, count=1)
        counts = [rows[0]["times_delivered"] if rows else 1 for rows in pipe.execute()]
        if held:
            pipe = self.client.pipeline(transaction=False)
            for entry_id, n in zip(held, counts[len(ids):]):
                pipe.xclaim(stream, Keys.GROUP, self.consumer, 0, [entry_id], retrycount=max(1, n - 1), justid=True)
            pipe.execute()
        return counts[:len(ids)]

    def hand_back(self, entries: dict[str, list[str]]) -> None:
        """Make entries we will not finish reclaimable by others now, without counting a delivery. Redis out of
        reach: they return after the reclaim timeout."""
        if not any(entries.values()):
            return
        try:
            self._hand_back(entries)
        except FAILOVER_ERRORS:
            log.warning("could not hand back jobs; they return after the reclaim timeout")

    def _hand_back(self, entries: dict[str, list[str]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for stream, ids in entries.items():
            if ids:
                pipe.xclaim(stream, Keys.GROUP, self.consumer, 0, ids, idle=HANDBACK_IDLE_MS, justid=True)
        pipe.execute()


def entries_of(tickets: list[Ticket], streams: list[str]) -> dict[str, list[str]]:
    """The tickets' entry ids by stream, every stream we read listed."""
    entries: dict[str, list[str]] = {st: [] for st in streams}
    for ticket in tickets:
        entries.setdefault(ticket.stream, []).append(ticket.entry_id)  # a tenant's stream (fair share) is not listed
    return entries
