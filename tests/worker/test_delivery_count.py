"""A delivery is counted once, by Redis, before the worker decodes the entry (issue 45.1). Redis (6.2 and 7) counts a
history read of XREADGROUP (a restarted worker reading its own pending entries) as a delivery; the worker added one
more on top, so each restart counted two and a healthy job could reach max_deliveries in half the restarts."""
from __future__ import annotations

from kvgate.producer.keys import Keys
from kvgate.worker.leases import Leases


def _read_twice(r, stream: str) -> str:
    r.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
    entry = r.xadd(stream, {"p": b"x"}).decode()
    r.xreadgroup(Keys.GROUP, "w", {stream: ">"})  # the first delivery
    r.xreadgroup(Keys.GROUP, "w", {stream: "0"})  # the same worker id, restarted: its own pending again
    return entry


def test_a_restarted_workers_read_of_its_pending_entry_counts_one_delivery(redis_server):
    r = redis_server.client()
    entry = _read_twice(r, "s")
    assert Leases(r, "w").count_delivery("s", [entry]) == [2]
    assert r.xpending_range("s", Keys.GROUP, "-", "+", 1)[0]["times_delivered"] == 2


def test_an_entry_still_held_when_its_pending_is_read_again_keeps_its_count(redis_server):
    """A rewind after a lost reply reads entries the worker still runs: no delivery for them."""
    r = redis_server.client()
    entry = _read_twice(r, "s")
    assert Leases(r, "w").count_delivery("s", [], held=[entry]) == []
    assert r.xpending_range("s", Keys.GROUP, "-", "+", 1)[0]["times_delivered"] == 1
