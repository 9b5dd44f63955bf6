"""Job-stream hygiene: trim only entries that every consumer group has acknowledged.

The safe floor is the smallest id still pending in any group, or, where nothing is pending, the entry
after the group's last delivered one. Group info is read before the pending summary: an entry delivered
in between has an id above the old last-delivered id, so the floor never passes it.
"""
from __future__ import annotations

import redis


def _parse_id(value) -> tuple[int, int]:
    text = value.decode() if isinstance(value, bytes) else str(value)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def acked_floor(client: redis.Redis, stream: str) -> str | None:
    """The smallest id that some group may still need; None when there is no group or nothing delivered."""
    groups = client.xinfo_groups(stream)
    if not groups:
        return None
    floor = None
    for group in groups:
        ms, seq = _parse_id(group["last-delivered-id"])
        candidate = (ms, seq + 1)
        if group["pending"]:
            summary = client.xpending(stream, group["name"])
            if summary["min"] is not None:
                candidate = min(candidate, _parse_id(summary["min"]))
        floor = candidate if floor is None else min(floor, candidate)
    if floor is None or floor <= (0, 1):
        return None
    return f"{floor[0]}-{floor[1]}"


def trim(client: redis.Redis, stream: str) -> int:
    """Remove acknowledged entries below the floor; returns how many went."""
    try:
        floor = acked_floor(client, stream)
    except redis.ResponseError:  # no such stream yet
        return 0
    if floor is None:
        return 0
    return client.xtrim(stream, minid=floor, approximate=False)
