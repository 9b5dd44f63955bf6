"""Publishing: token deltas once per step in one pipeline, and each final event in one atomic script.

The script makes the result durable, answers the client and acknowledges the job together (invariant 2),
and answers nothing when a result already exists, so a redelivered job is never answered twice. What a
failed round trip left unsent stays in the outbox and goes out again after the reconnect.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import redis

from kvgate.producer.protocol import FIELD, Delta, Final, Keys, encode

# KEYS: result, reply stream, job stream, dead stream
# ARGV: payload, result ttl, group, entry id, reply maxlen, reply ttl, field, dead reason ('' = none), dead maxlen,
#       the job's own payload (kept in the dead stream)
FINISH_LUA = """
local fresh = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
if fresh then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', ARGV[7], ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[6])
  if ARGV[8] ~= '' then
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[9], '*', 'reason', ARGV[8], 'stream', KEYS[3], 'entry', ARGV[4], 'job', ARGV[10])
  end
end
if ARGV[4] ~= '' then redis.call('XACK', KEYS[3], ARGV[3], ARGV[4]) end
if fresh then return 1 end
return 0
"""


@dataclass(slots=True)
class Finish:
    """One job's final event, bound to the stream entry it acknowledges."""

    final: Final
    client_id: str
    stream: str
    entry_id: str
    dead_reason: str = ""
    job_payload: bytes = b""


@dataclass(slots=True)
class Publisher:
    client: redis.Redis
    keys: Keys
    result_ttl_s: int
    reply_ttl_s: int
    reply_maxlen: int
    dead_maxlen: int
    deltas: list[tuple[str, Delta]] = field(default_factory=list)
    finishes: list[Finish] = field(default_factory=list)
    script: object = None

    def __post_init__(self) -> None:
        self.script = self.client.register_script(FINISH_LUA)  # EVALSHA, loading the script on NOSCRIPT

    def delta(self, client_id: str, delta: Delta) -> None:
        self.deltas.append((client_id, delta))

    def finish(self, finish: Finish) -> None:
        self.finishes.append(finish)

    @property
    def pending(self) -> int:
        return len(self.deltas) + len(self.finishes)

    def flush(self) -> list[tuple[Finish, bool]]:
        """Send the outbox in one round trip; returns (finish, answered) pairs. Raises on a lost connection,
        keeping the outbox for the retry."""
        if not self.pending:
            return []
        pipe = self.client.pipeline(transaction=False)
        n = self.fill(pipe)
        return self.settle(pipe.execute()[:n])

    def fill(self, pipe) -> int:
        """Queue the outbox on `pipe` (which may carry other commands after it); returns how many replies
        belong to the outbox, for `settle`."""
        replies = set()
        for client_id, delta in self.deltas:
            reply = self.keys.reply(client_id)
            pipe.xadd(reply, {FIELD: encode(delta)}, maxlen=self.reply_maxlen, approximate=True)
            replies.add(reply)
        for reply in replies:
            pipe.expire(reply, self.reply_ttl_s)
        for f in self.finishes:
            self._finish(pipe, f)
        return len(self.deltas) + len(replies) + len(self.finishes)

    def settle(self, results: list) -> list[tuple[Finish, bool]]:
        """The outbox went out: clear it; returns (finish, answered) pairs."""
        finishes, self.deltas, self.finishes = self.finishes, [], []
        answered = results[len(results) - len(finishes):]
        return [(f, bool(r)) for f, r in zip(finishes, answered)]

    def _finish(self, pipe, f: Finish) -> None:
        payload = encode(f.final)
        keys = [self.keys.result(f.final.job_id), self.keys.reply(f.client_id), f.stream, self.keys.dead()]
        args = [payload, self.result_ttl_s, Keys.GROUP, f.entry_id, self.reply_maxlen, self.reply_ttl_s, FIELD,
                f.dead_reason, self.dead_maxlen, f.job_payload]
        self.script(keys=keys, args=args, client=pipe)

    def dead_letter(self, stream: str, entry_id: str, reason: str, payload: bytes | None) -> None:
        """A job nobody can be told about: record it in the dead stream and acknowledge it, atomically."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.keys.dead(), {"reason": reason, "stream": stream, "entry": entry_id, "job": payload or b""},
                  maxlen=self.dead_maxlen, approximate=True)
        pipe.xack(stream, Keys.GROUP, entry_id)
        pipe.execute()
