"""Publishing: token deltas once per step in one pipeline, and each final event in one atomic script.

The script makes the result durable, answers the client and acknowledges the job together (invariant 2),
and answers nothing when a result already exists, so a redelivered job is never answered twice. What a
failed round trip left unsent stays in the outbox and goes out again after the reconnect.

A failure that belongs to one job (a reply key a producer turned into another type: WRONGTYPE) is that job's
failure, not the server's: resending the batch would fail the same way forever and stop the worker
(invariant 8), so it is reported per job and the rest of the batch counts as sent.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import redis

from kvgate.producer.cluster import NodeLinks, run_script
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD, Delta, Final, encode
from kvgate.producer.redis_url import Durability, NotReplicated
from kvgate.worker.named import Named

log = logging.getLogger("kvgate.worker")

# KEYS: result, reply stream, job stream, dead stream
# ARGV: payload, result ttl, group, entry id, reply maxlen, reply ttl, field, dead reason ('' = none), dead maxlen,
#       the job's own payload (kept in the dead stream)
# The reply goes first: a server-side refusal there (OOM, NOPERM) returns before anything is written, so the retry
# finds no result and answers. A reply key a producer made another type (WRONGTYPE) is that job's alone: the result
# still goes to its key, with a dead letter saying why the reply stream did not get it.
FINISH_LUA = """
local fresh = redis.call('EXISTS', KEYS[1]) == 0
if fresh then
  local dead = ARGV[8]
  local ok, err = pcall(redis.call, 'XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', ARGV[7], ARGV[1])
  if ok then
    redis.call('EXPIRE', KEYS[2], ARGV[6])
  else
    local msg = type(err) == 'table' and err.err or tostring(err)
    if not string.find(msg, 'WRONGTYPE', 1, true) then return redis.error_reply(msg) end
    local why = 'reply key ' .. KEYS[2] .. ' is not a stream (' .. msg .. '): the final event is only in ' .. KEYS[1]
    dead = dead == '' and why or (dead .. '; ' .. why)
  end
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  if dead ~= '' then
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[9], '*', 'reason', dead, 'stream', KEYS[3], 'entry', ARGV[4], 'job', ARGV[10])
  end
end
if ARGV[4] ~= '' then redis.call('XACK', KEYS[3], ARGV[3], ARGV[4]) end
if fresh then return 1 end
return 0
"""


def job_failure(error: Exception) -> bool:
    """Whether a command's error belongs to the key it touched (so to one job) rather than to the server."""
    return isinstance(error, redis.ResponseError) and "WRONGTYPE" in str(error)


@dataclass(slots=True)
class Finish:
    """One job's final event, bound to the stream entry it acknowledges."""

    final: Final
    client_id: str
    stream: str
    entry_id: str
    dead_reason: str = ""
    job_payload: bytes = b""
    tenant: str | None = None  # the job's, for the metrics; None: it named none, or could not be decoded

    @property
    def key(self) -> str:
        return f"{self.stream}|{self.entry_id}"


@dataclass(slots=True)
class Settled:
    """What one round trip of the outbox did."""

    answered: list[tuple[Finish, bool]]  # (finish, whether it answered the client)
    failed_jobs: dict[str, str]  # request key -> why its delta could not be published
    failed_finishes: list[tuple[Finish, str]]


@dataclass(slots=True)
class OutboxReplies:
    """What one round trip answered for the outbox, part by part (split in one place: Publisher.replies_of)."""

    deltas: list = field(default_factory=list)  # one per delta sent, in order
    expires: list = field(default_factory=list)  # one per reply stream the deltas went to
    finishes: list = field(default_factory=list)  # one per final, in order (on links: the links' replies)
    wait: Any = None  # the WAIT's reply (on links: the fewest replicas any WAIT saw, or its error); None: none went

    def all(self) -> list:
        return [*self.deltas, *self.expires, *self.finishes, *([] if self.wait is None else [self.wait])]


@dataclass(slots=True)
class Publisher:
    client: redis.Redis
    keys: Keys
    result_ttl_s: int
    reply_ttl_s: int
    reply_maxlen: int
    dead_maxlen: int
    deltas: list[tuple[str, Delta, str]] = field(default_factory=list)  # (client id, delta, request key)
    # a request key is `stream|entry id`: the job's reply stream is in its stream's shard (producer/shards.py)
    finishes: list[Finish] = field(default_factory=list)
    sending: tuple[list, list] = field(default_factory=lambda: ([], []))  # (deltas, finishes) filled, not settled
    script: object = None
    durability: Durability = field(default_factory=Durability)
    waiting: bool = False  # the pipeline being filled carries a WAIT after the finals (replicated durability)
    links: NodeLinks | None = None  # replicated on a Redis Cluster: finals go per shard on links, each with a WAIT
    expiring: int = 0  # reply streams the last fill expired (one EXPIRE each, after the deltas)
    on_links: bool = False  # the last fill's finals go on links, not on its pipeline
    linked: OutboxReplies | None = None  # their replies, once the round trip sent them

    def __post_init__(self) -> None:
        self.script = self.client.register_script(FINISH_LUA)  # EVALSHA, loading the script on NOSCRIPT

    def delta(self, client_id: str, delta: Delta, key: str = "") -> None:
        self.deltas.append((client_id, delta, key))

    def finish(self, finish: Finish) -> None:
        self.finishes.append(finish)

    def forget(self, keys: set[str]) -> None:
        """Drop what the outbox holds for these jobs (leases lost: another worker answers them)."""
        self.deltas = [d for d in self.deltas if d[2] not in keys]
        self.finishes = [f for f in self.finishes if f.key not in keys]
        deltas, finishes = self.sending
        self.sending = [d for d in deltas if d[2] not in keys], [f for f in finishes if f.key not in keys]

    @property
    def pending(self) -> int:
        return len(self.deltas) + len(self.finishes) + len(self.sending[0]) + len(self.sending[1])

    @property
    def filled(self) -> bool:
        """The last fill queued something to send (on its pipeline, or finals for the links)."""
        return bool(self.sending[0] or self.sending[1])

    def requeue(self) -> None:
        """The round trip carrying the last fill failed: its events go out again first, before newer ones."""
        deltas, finishes = self.sending
        self.deltas, self.finishes, self.sending = deltas + self.deltas, finishes + self.finishes, ([], [])

    def flush(self) -> Settled:
        """Send the outbox in one round trip. Raises on a lost connection or a server-side refusal, keeping the
        outbox for the retry."""
        if not self.pending:
            return Settled([], {}, [])
        pipe = self.client.pipeline(transaction=False)
        self.fill(pipe)
        try:
            replies = self.round_trip(pipe)
        except BaseException:
            self.requeue()
            raise
        return self.settle(replies)  # the pipeline carried the outbox only

    def fill(self, pipe) -> int:
        """Queue the outbox on `pipe` (which may carry other commands after it); returns how many replies
        belong to the outbox, for `settle`. Until then the outbox takes new events for the next fill (the
        worker steps the engine while the pipeline is on its way)."""
        if self.sending[0] or self.sending[1]:
            raise RuntimeError("the previous fill has not settled: settle or requeue it first")
        self.sending, self.deltas, self.finishes = (self.deltas, self.finishes), [], []
        deltas, finishes = self.sending
        replies = set()
        for client_id, delta, key in deltas:
            reply = self.reply_of(client_id, key.partition("|")[0])
            pipe.xadd(reply, {FIELD: encode(delta)}, maxlen=self.reply_maxlen, approximate=True)
            replies.add(reply)
        for reply in replies:
            pipe.expire(reply, self.reply_ttl_s)
        self.waiting = self.durability.replicated and bool(finishes)
        self.expiring, self.on_links, self.linked = len(replies), self.links is not None and bool(finishes), None
        if self.on_links:
            return len(deltas) + len(replies)
        for f in finishes:
            self._finish(pipe, f)
        if self.waiting:
            self.durability.wait(pipe)  # same connection, after the finals: counts them and everything before
        return len(deltas) + len(replies) + len(finishes) + self.waiting

    def round_trip(self, pipe) -> list:
        """Run the pipeline `fill` filled (raise_on_error=False); with links, then the finals on them (their replies
        kept for `settle`)."""
        replies = pipe.execute(raise_on_error=False)
        if self.on_links:
            self.linked = self._send_linked()
        return replies

    def _send_linked(self) -> OutboxReplies:
        """Each shard's finals on the link to its primary, then WAIT there: the replies in the finals' order, and the
        fewest replicas any WAIT saw (or its error)."""
        finishes = self.sending[1]
        out: list = [None] * len(finishes)
        waits = []
        for group in self.keys.by_shard(range(len(finishes)), lambda i: finishes[i].stream):
            def writes(link, group=group):
                named = Named(link.pipeline(transaction=False))
                for i in group:
                    self._finish(named.on(i), finishes[i])
                self.durability.wait(named.on("wait"))
                return named.execute(raise_on_error=False)

            replies = self.links.run(finishes[group[0]].stream, writes)
            for i in group:
                out[i] = replies[i]
            waits.append(replies["wait"])
        failed = next((w for w in waits if isinstance(w, Exception)), None)
        return OutboxReplies(finishes=out, wait=failed if failed is not None else min(int(w) for w in waits))

    def settle(self, results: list) -> Settled:
        """The last fill went out (the pipeline ran with raise_on_error=False): sort the per-job failures out. A
        server-side error (OOM, READONLY, ...) puts all of it back in the outbox and raises, so it goes again."""
        got = self.replies_of(results)
        server = next((r for r in got.all() if isinstance(r, Exception) and not job_failure(r)), None)
        if server is not None:
            self.requeue()
            raise server
        if self.waiting:
            self._replicated(got.wait)
        (deltas, finishes), self.sending = self.sending, ([], [])
        failed_jobs = {key: str(r) for (_, _, key), r in zip(deltas, got.deltas) if isinstance(r, Exception)}
        failed = [(f, str(r)) for f, r in zip(finishes, got.finishes) if isinstance(r, Exception)]
        answered = [(f, bool(r)) for f, r in zip(finishes, got.finishes) if not isinstance(r, Exception)]
        return Settled(answered, failed_jobs, failed)

    def replies_of(self, results: list) -> OutboxReplies:
        """The last fill's replies (the outbox's part of its pipeline's, in the order `fill` queued them) by part."""
        deltas, finishes = self.sending
        d, e = len(deltas), self.expiring
        if self.linked is not None:
            return OutboxReplies(results[:d], results[d:d + e], self.linked.finishes, self.linked.wait)
        f = d + e + len(finishes)
        return OutboxReplies(results[:d], results[d:d + e], results[d + e:f], results[f] if self.waiting else None)

    def _replicated(self, wait_reply) -> None:
        """No replica confirmed: the deltas went out, but the finals stay in the outbox and go out again (the
        script answers once and acks again), so no job counts as settled while a failover could still drop it."""
        try:
            self.durability.check(wait_reply)
        except NotReplicated:
            self.sending = ([], self.sending[1])  # the deltas went out; the finals go again, first
            self.requeue()
            raise

    def reply_of(self, client_id: str, stream: str) -> str:
        """The client's reply stream in the shard of the job's stream."""
        return self.keys.of_stream(stream).reply(client_id)

    def _finish(self, pipe, f: Finish) -> None:
        payload = encode(f.final)
        shard = self.keys.of_stream(f.stream)
        keys = [shard.result(f.final.job_id), shard.reply(f.client_id), f.stream, shard.dead()]
        args = [payload, self.result_ttl_s, Keys.GROUP, f.entry_id, self.reply_maxlen, self.reply_ttl_s, FIELD,
                f.dead_reason, self.dead_maxlen, f.job_payload]
        run_script(self.script, keys, args, pipe)

    def dead_letter_finish(self, finish: Finish, reason: str) -> bool:
        """A final the finish script refused: dead-letter its job with the reason; whether that worked (if not,
        the entry stays pending: reclaimed later, dead-lettered at max_deliveries)."""
        why = f"final event could not be published: {reason}"
        log.error("job %s: %s", finish.final.job_id, why)
        try:
            self.dead_letter(finish.stream, finish.entry_id, why, finish.job_payload or None)
            return True
        except redis.ResponseError as e:
            log.error("job %s: could not dead-letter it either: %s", finish.final.job_id, e)
            return False

    def dead_letter(self, stream: str, entry_id: str, reason: str, payload: bytes | None) -> None:
        """A job nobody can be told about: record it in the dead stream and acknowledge it, atomically."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.keys.of_stream(stream).dead(), {"reason": reason, "stream": stream, "entry": entry_id, "job": payload or b""},
                  maxlen=self.dead_maxlen, approximate=True)
        pipe.xack(stream, Keys.GROUP, entry_id)
        pipe.execute()
