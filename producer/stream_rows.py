"""Many job streams' figures in two pipelined round trips, for backlog checks and stats.

Entries parked for deadline order (worker/due.py) are pending to the group but waiting: each row says how many (the
stream's due index's size), and lag_of counts them as not yet delivered.

Read one command at a time, a stats look cost up to four round trips per stream and a backlog check one, for each
known model's 3 priorities x (lanes + 1) streams: 99 a model with 32 lanes, every 0.1 s in a busy producer. Here every
stream's length and group come in one pipeline, and (for stats) the oldest entries of the streams that hold any in a
second one: the same commands any user allowed to read the streams may send (no script), in two round trips. Where
the server has no `lag` (Redis 6.2, or 7 after some deletions) the caller counts it from the row's last-delivered-id
(queue_stats.count_lag), as before.
"""
from __future__ import annotations

from dataclasses import dataclass

from .keys import Keys, as_text
from .steps import Steps, call


@dataclass(slots=True)
class StreamRow:
    length: int
    lag: int | None = None  # None: the server has none; count it from last_delivered
    pending: int = 0
    last_delivered: str = ""  # '': no group yet (nothing was ever delivered)
    oldest_pending: str = ""  # entry ids, '' for none
    next_undelivered: str = ""
    parked: int = 0  # pending to Keys.PARKED: read for deadline order, waiting still (worker/due.py)


def _row(length, groups) -> StreamRow:
    length = 0 if isinstance(length, Exception) else int(length)
    group = None if isinstance(groups, Exception) else next(
        (g for g in groups if as_text(g["name"]) == Keys.GROUP), None)
    if group is None:  # no group (or no stream) yet: every entry waits
        return StreamRow(length, length)
    lag = group.get("lag")
    return StreamRow(length, None if lag is None else int(lag), int(group["pending"]),
                     as_text(group["last-delivered-id"]))


def read_rows(r, keys: Keys, streams: list[str], oldest: bool = False) -> Steps:
    """Each stream's row; with `oldest`, its oldest pending and first undelivered entry ids too."""
    pipe = r.pipeline(transaction=False)
    for stream in streams:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
        pipe.zcard(keys.due_index(stream))
    replies = yield call(pipe.execute, raise_on_error=False)  # XINFO of a stream not made yet is an error
    rows = {st: _row(length, groups) for st, length, groups in zip(streams, replies[::3], replies[1::3])}
    for row, parked in zip(rows.values(), replies[2::3]):
        row.parked = min(parked, row.pending) if isinstance(parked, int) else 0
    if not oldest:
        return rows
    pipe, asked = r.pipeline(transaction=False), []
    for stream, row in rows.items():
        if not row.length:
            continue
        if row.pending:
            pipe.xpending(stream, Keys.GROUP)
            asked.append((row, "oldest_pending"))
        pipe.xrange(stream, min=f"({row.last_delivered}" if row.last_delivered else "-", max="+", count=1)
        asked.append((row, "next_undelivered"))
    for (row, name), reply in zip(asked, (yield call(pipe.execute, raise_on_error=False))):
        if isinstance(reply, Exception):
            continue
        entry = reply.get("min") if name == "oldest_pending" else reply[0][0] if reply else None
        if entry:
            setattr(row, name, as_text(entry))
    return rows
