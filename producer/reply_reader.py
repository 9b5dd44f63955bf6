"""One reader per client: XREAD BLOCK on the client's reply stream, events routed to handles.

ReaderState is the loop's logic without I/O, so the thread (Client) and the task (AsyncClient)
run the same steps. Besides reading, the loop keeps the reply stream alive (EXPIRE), trims what it
has read, and polls result keys for jobs whose events go elsewhere (a job another client owns) or
whose final event was missed (e.g. the reply stream expired or Redis lost it in a restart).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import redis

from .cluster import get_many
from .mailbox import ReplyRouter
from .job_status import read_states
from .keys import Keys
from .protocol import FIELD, Delta, Final, ProtocolError, decode_event, decode_final
from .steps import Steps, call, run

log = logging.getLogger(__name__)

READ_COUNT = 512
WAKE_FIELD = "wake"  # an entry the client writes to its own stream to end a blocking read at close


@dataclass(slots=True)
class ReaderState:
    keys: Keys
    client_id: str
    router: ReplyRouter
    reply_ttl_s: int = 3600
    block_ms: int = 1000
    foreign_poll_s: float = 0.2
    fallback_after_s: float = 2.0
    last_id: str = "0-0"
    next_expire: float = 0.0
    next_foreign: float = 0.0
    next_fallback: float = 0.0
    maintain: bool = True  # EXPIRE and XTRIM our own reply stream; off once Redis says this user may not
    liveness: bool = True  # look for lost jobs; off once Redis says this user may not run the script
    liveness_due: bool = False
    shard: int = 0  # the shard whose reply stream this reader follows; shard 0's also polls results and liveness
    release: Callable[[], Steps] | None = None  # gives back the quota slots of jobs that settled (client_base.py)
    stream: str = field(init=False)

    def __post_init__(self):
        self.stream = self.keys.reply(self.client_id, self.shard)

    def block_for_ms(self) -> int:
        if self.router.has_foreign():
            return max(1, int(self.foreign_poll_s * 1000))
        return self.block_ms

    def absorb(self, response) -> int:
        """Route the events of one XREAD response; returns how many entries it held."""
        events: list[Delta | Final] = []
        entries = response[0][1] if response else []
        for entry_id, fields in entries:
            self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            payload = fields.get(FIELD.encode()) or fields.get(FIELD)
            if payload is None:
                continue  # a wake entry
            try:
                events.append(decode_event(payload))
            except ProtocolError as e:
                log.warning("skipping undecodable reply event %s on %s: %s", self.last_id, self.stream, e)
        self.router.route(events)
        return len(entries)

    def refused(self, e: redis.exceptions.NoPermissionError) -> None:
        """A least-privilege producer (deploy/redis/acl.conf) may read its reply stream but not write it: leave
        its expiry and trimming to the workers (MAXLEN and EXPIRE on each publish) instead of failing reads."""
        self.maintain = False
        log.info("reply stream %s is read-only for this Redis user (%s); the workers cap and expire it", self.stream, e)

    def expire_due(self, now: float) -> bool:
        if not self.maintain or now < self.next_expire:
            return False
        self.next_expire = now + self.reply_ttl_s / 3
        return True

    def polls_due(self, now: float) -> list[str]:
        """Job ids whose result key to read now."""
        ids: list[str] = []
        if self.shard != 0:
            return ids
        if now >= self.next_foreign:
            self.next_foreign = now + self.foreign_poll_s
            ids += self.router.unfinished(foreign=True)
        if now >= self.next_fallback:
            self.next_fallback = now + self.fallback_after_s
            ids += self.router.unfinished(foreign=False, older_than_s=self.fallback_after_s)
            self.liveness_due = self.liveness
        return ids

    def suspects(self, ids: list[str]) -> dict[str, list[tuple[str, str]]]:
        """After the result poll: the unfinished jobs whose entry we know, by stream, to check for loss.
        Only on the fallback cadence, so a job is found lost within about two fallback periods."""
        if not self.liveness_due:
            return {}
        self.liveness_due = False
        by_stream: dict[str, list[tuple[str, str]]] = {}
        for job_id, stream, entry in self.router.entries(ids):
            by_stream.setdefault(stream, []).append((job_id, entry))
        return by_stream

    def absorb_states(self, states) -> None:
        for state in states:
            if state.state == "lost":
                self.router.mark_lost(state.job_id, state.detail)

    def liveness_refused(self, e: Exception) -> None:
        self.liveness = False
        log.info("this Redis user may not inspect job streams (%s); lost jobs end in ResultTimeout only", e)

    def absorb_results(self, raws: list[bytes | None]) -> None:
        finals: list[Final] = []
        for raw in raws:
            if raw is None:
                continue
            try:
                finals.append(decode_final(raw))
            except ProtocolError as e:
                log.warning("skipping undecodable stored result: %s", e)
        self.router.route(finals)

    # -- one round of the loop, as steps (steps.py): the thread runs them with blocking calls, the task awaits them
    def step(self, conn, states_script) -> Steps:
        """Keep the stream alive, poll results and look for lost jobs when due, then one blocking XREAD."""
        now = time.monotonic()
        if self.expire_due(now):
            yield from self._maintain(call(conn.expire, self.stream, self.reply_ttl_s))
        ids = self.polls_due(now)
        for i in range(0, len(ids), 1000):
            self.absorb_results((yield call(get_many, conn, [self.keys.result(j) for j in ids[i:i + 1000]])))
        yield from self.check_liveness(ids, conn, states_script)
        response = yield call(conn.xread, {self.stream: self.last_id}, count=READ_COUNT, block=self.block_for_ms())
        if self.absorb(response) and self.maintain:
            yield from self._maintain(call(conn.xtrim, self.stream, minid=self.last_id, approximate=True))
        if self.release is not None:
            yield from self.release()

    def check_liveness(self, ids: list[str], conn, states_script) -> Steps:
        """Mark lost the unfinished jobs that are in no stream, pending nowhere and have no result."""
        for stream, jobs in self.suspects(ids).items():
            for i in range(0, len(jobs), 500):
                try:
                    self.absorb_states((yield from read_states(conn, states_script, self.keys, stream, jobs[i:i + 500])))
                except redis.ResponseError as e:
                    if not is_noperm(e):
                        raise
                    self.liveness_refused(e)
                    return

    def _maintain(self, command) -> Steps:
        try:
            yield command
        except redis.exceptions.NoPermissionError as e:  # a read-only reply stream: see refused
            self.refused(e)


class ReplyReader(threading.Thread):
    """The Client's reader thread; its own connection, so a blocking read never holds the client's pool."""

    def __init__(self, conn: redis.Redis, state: ReaderState, states_script):
        super().__init__(name=f"kvgate-reply-{state.client_id[:6]}", daemon=True)
        self.conn, self.state, self.states_script = conn, state, states_script
        self._stopping = threading.Event()

    def run(self) -> None:
        backoff = 0.05
        while not self._stopping.is_set():
            try:
                self._step()
                backoff = 0.05
            except Exception as e:  # the reader must outlive outages and surprises alike
                if self._stopping.is_set():
                    break
                log.warning("reply reader: %r; retrying in %.2f s", e, backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 2.0)
        self.conn.close()

    def _step(self) -> None:
        run(self.state.step(self.conn, self.states_script))

    def stop(self, waker: redis.Redis, timeout: float = 5.0) -> None:
        self._stopping.set()
        try:
            waker.xadd(self.state.stream, {WAKE_FIELD: "1"})
        except redis.RedisError:
            pass  # the read then ends at its block timeout instead
        self.join(timeout)


def is_noperm(e: Exception) -> bool:
    return isinstance(e, redis.exceptions.NoPermissionError) or "NOPERM" in str(e)
