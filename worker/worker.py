"""The worker loop: admit jobs from Redis by KV capacity, step the engine, publish, renew, reclaim, drain.

One Worker owns one engine and its own Redis connection; several can run in threads of one process
(the fleet simulation) sharing nothing but Redis.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvgate.engine.detokenizer import TextDelta
from kvgate.engine.detokenizer_thread import DetokenizerThread, StepText
from kvgate.engine.outputs import RequestRejected, StepOutput
from kvgate.producer.protocol import (PROTOCOL_VERSION, Delta, Final, Keys, ProtocolError, Timings, TokenLogprob, Usage,
                                      as_text, decode_job, mask_url)
from kvgate.producer.cluster import NodeLinks, is_noscript, scripts_lost
from kvgate.producer.redis_url import connect, keys_for
from kvgate.worker.admission import AdmissionQueue, Ticket
from kvgate.worker.affinity import Affinity
from kvgate.worker.clock import ServerClock, entry_ms
from kvgate.worker.consumers import Consumers
from kvgate.worker.heartbeat import Heartbeat, engine_capacity
from kvgate.worker.intake import identify, payload_of, prompt_ids, sampling_params
from kvgate.worker.lane_prefixes import LanePrefixes
from kvgate.worker.leases import Leases
from kvgate.worker.logprobs import TokenRenderer
from kvgate.worker.publisher import Finish, Publisher, Settled
from kvgate.worker.reader import Reader
from kvgate.worker.served import served_models
from kvgate.worker.settings import WorkerSettings
from kvgate.worker.trim import trim

log = logging.getLogger("kvgate.worker")
# ClusterError: a Redis Cluster with slots uncovered (a failover under way) or a node's connections exhausted
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, redis.exceptions.ClusterError)
CLUSTER_BLOCK_MS = 100  # a blocking read waits on one shard of a cluster; then the next look covers them all
TRIM_ALL_EVERY = 12  # trims: every 12th looks at every stream (a minute at the default trim_interval_s)


@dataclass(slots=True)
class Flight:
    """A job the engine is running."""

    ticket: Ticket
    admitted_at: float
    first_token_at: float | None = None
    deltas: int = 0
    logprobs: list[TokenLogprob] | None = None  # every token's so far, when the job asked
    undecoded: list[TokenLogprob] = field(default_factory=list)  # rendered, their text not yet decoded
    ending: str | None = None  # cancelled in the engine; the status to answer once its last text is decoded


@dataclass(slots=True)
class Exchange:
    """One round trip on its way on the I/O thread while the engine steps: what its replies belong to."""

    replies: Future
    n_out: int
    count: int
    reclaim_ms: int
    polled: list[Ticket] = field(default_factory=list)  # in the order of their cancel flags (shard by shard)
    n_polls: int = 0  # MGETs of cancel flags at the end of the replies, one per shard
    told: int = 0  # commands saying whether we are full (lanes), right after the publishing
    looked: int = 0  # reads of who is full (lanes), right after the refill read
    held: int = 0  # jobs asked of lanes whose prefix we hold, in a read before the refill read (its reply first)


class NullMetrics:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def default_worker_id() -> str:
    return os.environ.get("KVGATE_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}"


def make_metrics(worker_id: str, model: str):
    try:
        from kvgate.worker.metrics import WorkerMetrics
    except ImportError:
        return NullMetrics()
    return WorkerMetrics(worker_id, model)


def kv_weight(engine) -> float:
    """Our share of affinity lanes follows the KV blocks we hold: that is where a prefix cache lives."""
    try:
        blocks = engine.stats.total_blocks
    except AttributeError:
        return 1.0
    return float(blocks) if isinstance(blocks, int) and blocks > 0 else 1.0


class Worker:
    def __init__(self, redis_url: str, engine, *, namespace: str = "kvgate", worker_id: str | None = None,
                 settings: WorkerSettings | None = None, metrics=None):
        self.engine = engine
        self.settings = s = settings or WorkerSettings(redis_url=redis_url, namespace=namespace)
        self.worker_id = worker_id or s.worker_id or default_worker_id()
        self.served = served_models(getattr(engine, "model_name", "unknown"), s.served_model_name, s.model_aliases,
                                    s.serve_default)
        self.model = self.served.canonical
        self.url = mask_url(redis_url)  # for messages: the password never reaches a log
        self.client = connect(redis_url, socket_timeout=s.block_ms / 1000 + 5, socket_connect_timeout=2,
                                           retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 1))
        self.keys = keys_for(redis_url, self.client, namespace)  # on a cluster: learns the namespace's shards
        self.streams = self.keys.served_jobs(list(self.served.names))
        self.metrics = metrics if metrics is not None else make_metrics(self.worker_id, self.model)
        self.renderer = TokenRenderer(getattr(engine, "tokenizer", None))
        self.queue = AdmissionQueue(s.local_queue_size, float(s.initial_tokens_per_job))
        self.flights: dict[str, Flight] = {}
        self.publisher = Publisher(self.client, self.keys, s.result_ttl_s, s.reply_ttl_s, s.reply_maxlen,
                                   s.dead_maxlen, durability=s.replication,
                                   links=NodeLinks(self.client, redis_url) if self.keys.cluster and
                                   s.replication.replicated else None)
        self.reader = Reader(self.client, self.worker_id, self.streams, len(self.served.names),
                             steal_age_ms=s.affinity_steal_age_ms, keys=self.keys)
        self.leases = Leases(self.client, self.worker_id)
        self.consumers = Consumers(self.client, self.keys, self.worker_id, self.streams, s.reclaim_idle_ms)
        self.reclaim_due = False  # the next read takes over dead workers' entries before new ones
        self.renewed_at = time.monotonic()
        self.clock = ServerClock(self.client)
        self.affinity = Affinity(self.client, self.keys, self.worker_id, s.affinity == "on", s.affinity_lanes,
                                 s.heartbeat_ttl_s * 1000, weight=kv_weight(engine), models=self.served.names)
        self.lane_prefixes = LanePrefixes(getattr(engine, "block_size", 16))
        self.held_dry_until = 0.0  # a read of the lanes whose prefix we hold found none: no such read till then
        self.heartbeat = Heartbeat(self.client, self.keys, self.worker_id, self.model, self.served.heartbeat,
                                   engine_capacity(engine), s.heartbeat_ttl_s)
        self.cursors: dict[str, str | None] = {st: "0" for st in self.streams}  # own pending first, then ">"
        self.due: dict[str, float] = {}
        self.offline_until = 0.0
        self.backoff_s = 0.05
        self.jobs_done = 0
        self.draining = False
        self.drain_deadline = 0.0
        self.last_read_empty_at = 0.0
        self.acked: set[str] = set()  # streams we acknowledged entries of since the last trim
        self.trims = 0
        self.block_turn = 0  # on a cluster: the shard the next blocking read waits on
        self.empty_reads = 0  # consecutive empty refill reads: back off while the backlog stays empty
        # Text is decoded on its own thread and Redis round trips run on another, both while the engine steps.
        tokenizer = getattr(engine, "tokenizer", None)
        self.detok = DetokenizerThread(tokenizer) if tokenizer is not None else None
        self.io = ThreadPoolExecutor(1, thread_name_prefix="kvgate-io")
        self.sent: Exchange | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def run(self, stop_event: threading.Event | None = None) -> int:
        stop_event = stop_event or threading.Event()
        log.info("worker %s serving %s (model names %s) from %s", self.worker_id, self.model,
                 ", ".join(self.served.names), self.settings.namespace)
        self._redis(self._ensure_groups)
        while True:
            if stop_event.is_set() and not self.draining:
                self._begin_drain()
            if self.draining and self._drained():
                break
            self._iterate()
        self._finish_drain()
        return 0

    def _iterate(self) -> None:
        online = time.monotonic() >= self.offline_until
        if online:
            self._redis(self._housekeep)
            if not self.draining:
                self._redis(self._intake)
        self._admit_local()
        busy = self.engine.has_unfinished()
        if busy:
            self._step()  # the last step's text decodes and its round trip runs meanwhile, on their threads
        if self.detok is not None and self.detok.in_flight:
            # the text of the step before this one; all of it when nothing runs now, so nothing waits a step
            self._collect_text(lag=1 if self.engine.has_unfinished() else 0)
        if not busy and not online:
            time.sleep(max(0.0, min(self.offline_until - time.monotonic(), 0.5)))
        elif not busy and self.draining:
            time.sleep(0.01)  # nothing left to run; waiting for the outbox to go out
        if time.monotonic() >= self.offline_until:
            self._redis(self._exchange)

    def _redis(self, fn) -> None:
        """Run one Redis phase; on an outage keep the engine going and retry Redis after a backoff."""
        try:
            fn()
            self.backoff_s = 0.05
        except REDIS_DOWN as e:
            log.warning("redis unavailable at %s (%s: %s); retrying in %.2fs", self.url,
                        e.__class__.__name__, e, self.backoff_s)
            self.offline_until = time.monotonic() + self.backoff_s
            self.backoff_s = min(self.backoff_s * 2, self.settings.max_backoff_s)
            self.cursors = {st: "0" for st in self.streams}  # a lost XREADGROUP reply left entries pending to us
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):  # streams deleted or Redis restarted without persistence
                self._redis(self._ensure_groups)
                return
            if is_noscript(e):  # a cluster primary that never loaded our scripts (promoted, or new after a reshard)
                scripts_lost(self.reader.script, self.publisher.script)
            # OOM, READONLY after a failover, BUSY script: the server's state, not ours; back off and retry
            log.error("redis refused a command: %s; retrying in %.2fs", e, self.backoff_s)
            self.offline_until = time.monotonic() + self.backoff_s
            self.cursors = {st: "0" for st in self.streams}  # a read in that pipeline may have delivered entries
            self.backoff_s = min(self.backoff_s * 2, self.settings.max_backoff_s)

    def _ensure_groups(self) -> None:
        self.client.sadd(self.keys.models(), *self.served.names)  # listed by stats and the gateway from now on
        self._sync_lanes()
        self._create_groups(self.streams)

    def _sync_lanes(self) -> None:
        """Learn the namespace's lanes and our share; the streams we read only ever grow (nothing stranded)."""
        if self.affinity.sync():
            new = [st for st in self.affinity.streams() if st not in self.streams]
            self._create_groups(new)
            self.streams += new
            self.reader.streams = self.consumers.streams = self.streams
            self.cursors.update({st: "0" for st in new})  # a restarted worker of the same id may hold entries there
        self.metrics.on_lanes(self.affinity.owned_count)

    def _create_groups(self, streams: list[str]) -> None:
        """One round trip for all of them: with lanes a worker reads hundreds of streams."""
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xgroup_create(stream, Keys.GROUP, id="0", mkstream=True)
        for reply in pipe.execute(raise_on_error=False) if streams else []:
            if isinstance(reply, redis.ResponseError) and "BUSYGROUP" not in str(reply):
                raise reply

    def _every(self, name: str, interval_s: float) -> bool:
        now = time.monotonic()
        if now < self.due.get(name, 0.0):
            return False
        self.due[name] = now + interval_s
        return True

    # ---- intake: Redis -> local queue ------------------------------------------------------------
    def _intake(self) -> None:
        adm = self.engine.admission()
        idle = not self.engine.has_unfinished() and not self.queue.tickets
        count = self.queue.read_count(adm.free_seqs, adm.admissible_tokens, idle)
        if count <= 0:
            return
        own_pending = any(c is not None for c in self.cursors.values())
        if own_pending or idle:
            self._settle_exchange()  # a read of its own may be on its way: its entries come first
        if own_pending:
            self._read_own_pending(count)
        elif idle and not self.publisher.pending:
            if not self._read_new(count):
                self._read_blocking(count)
        # a busy engine is refilled by _exchange, in the same round trip as the step's publishing

    def _read_own_pending(self, count: int) -> None:
        """Entries already pending to us (a restart under the same id, a lost reply): every stream in one round
        trip (with lanes there are hundreds), at most `count` taken; a stream cut short keeps its cursor."""
        cursors = {st: c for st, c in self.cursors.items() if c is not None}
        found = {}
        for group in self.keys.by_shard(list(cursors)):  # one slot per command on a cluster
            reply = self.client.xreadgroup(Keys.GROUP, self.worker_id, {st: cursors[st] for st in group}, count=count)
            found |= {as_text(st): entries for st, entries in reply or []}
        for stream in cursors:
            entries = [(as_text(i), f) for i, f in found.get(stream, [])][:count]
            self.cursors[stream] = entries[-1][0] if entries else None
            fresh = [(i, f) for i, f in entries if not self._holds(stream, i)]
            if fresh:
                deliveries = self.leases.count_delivery(stream, [i for i, _ in fresh])
                self._accept([(stream, i, f, n) for (i, f), n in zip(fresh, deliveries)])
            count -= len(entries)
            if count <= 0:
                return

    def _read_blocking(self, count: int) -> None:
        """Wait for the next job (with lanes: on the shared streams and our own lanes). COUNT 1 per stream, on at
        most `count` streams (the highest priorities): one entry per stream could arrive at once, and more than
        `count` would break the local queue's bound. A stream left out of this wait is read by the next
        non-blocking read, one block_ms later at most."""
        r = self.reader
        # with lanes, also on the lanes of owners that said they are full: their jobs are ours to take at once
        home = self.affinity.home() + r.streams[r.home:r.home + r.urgent] if self.affinity.lanes else r.order()
        shards = self.keys.by_shard(home)  # on a cluster: wait on one shard, the next one each time
        self.block_turn += 1
        streams = {st: ">" for st in shards[self.block_turn % len(shards)][:count]}
        reply = self.client.xreadgroup(Keys.GROUP, self.worker_id, streams, count=1, block=self._block_ms())
        self._accept([(as_text(st), as_text(i), f, 1) for st, entries in reply or [] for i, f in entries])

    def _block_ms(self) -> int:
        """With lanes an idle worker wakes once per steal age to look at others' lanes (it blocks on its own)."""
        block_ms = self.settings.block_ms
        if len(self.keys.parts) > 1:  # a wait covers one shard: come back soon to look at the others
            block_ms = min(block_ms, CLUSTER_BLOCK_MS)
        if self.affinity.enabled and self.affinity.lanes and self.settings.affinity_steal_age_ms:
            return max(1, min(block_ms, self.settings.affinity_steal_age_ms))
        return block_ms

    def _cancel_flags(self, tickets: list[Ticket], target) -> tuple[list[Ticket], list]:
        """One MGET of the tickets' cancel flags per shard, on a client or queued on a pipeline: the tickets in the
        order of the flags, and the MGETs' replies (a pipeline's come at execute)."""
        groups = self.keys.by_shard(tickets, lambda t: t.stream)
        replies = [target.execute_command("MGET", *[self.keys.of_stream(t.stream).cancel(t.job.job_id) for t in g])
                   for g in groups]
        return [t for g in groups for t in g], replies

    def _read_new(self, count: int, entries: list | None = None, reclaim_ms: int = 0,
                  drained: bool | None = None) -> int:
        if entries is None:  # an idle engine's look (the busy one reads in _exchange): it can afford every lane
            reclaim_ms = self._reclaim_ms()
            self._plan_read(reclaim_ms, full=True)
            entries = self.reader.read(count, reclaim_idle_ms=reclaim_ms)  # on a cluster: shard after shard
            if self.affinity.enabled and self.affinity.lanes:
                pipe = self.client.pipeline(transaction=False)
                told = self.affinity.tell(pipe, room=True)
                self.affinity.look(pipe)
                self.affinity.seen(pipe.execute()[told:])
        got = list(entries)
        if self.affinity.lanes:
            self._observe_lanes(got, len(got) < count if drained is None else drained)
        if reclaim_ms:
            claimed = sum(1 for e in got if e[3] > 1 or e[2] is None)
            self.reclaim_due = claimed >= count  # a full take may have left more behind
            if claimed:
                log.info("reclaimed %d entries idle past %d ms", claimed, reclaim_ms)
        if not got:
            self.last_read_empty_at = time.monotonic()
            self.empty_reads += 1
        else:
            self.empty_reads = 0
        self._accept(got)
        return len(got)

    def _plan_read(self, reclaim_ms: int, full: bool = False) -> None:
        r = self.reader
        r.streams, r.home, r.urgent, r.overdue = self.affinity.read_plan(full=full or reclaim_ms > 0)  # reclaim: all
        lag = self.settings.affinity_max_lag_ms
        r.overdue_ms = self.affinity.own_wait_ms + lag if lag else 0
        # A stolen job should start now, not wait in our local queue behind a wrong size estimate: one at a time,
        # and none while jobs wait here already.
        r.steal_max = 0 if self.queue.tickets else 1

    def _plan_held_read(self, lanes: list, count: int) -> None:
        r = self.reader
        r.streams, r.home, r.urgent = self.affinity.held_plan(lanes)
        r.overdue, r.overdue_ms = [], 0
        r.steal_max = count  # their jobs share a prefix in our cache: sized to fit as tails, taken to start now

    def _observe_lanes(self, got: list, drained: bool) -> None:
        fresh = [e for e in got if e[3] == 1]
        stolen = [e for e in fresh if self.affinity.stolen(e[0])]
        if stolen:
            self.metrics.on_steals(len(stolen))
            for stream in dict.fromkeys(e[0] for e in reversed(stolen)):
                self.affinity.stole(stream)
        now_ms = int(self.clock.now() * 1000)
        ages = [now_ms - entry_ms(e[1]) for e in fresh if not self.affinity.stolen(e[0])]
        self.affinity.observe(ages, drained)

    def _holds(self, stream: str, entry_id: str) -> bool:
        key = f"{stream}|{entry_id}"
        return key in self.flights or any(t.key == key for t in self.queue.tickets)

    def _accept(self, entries: list[tuple[str, str, dict, int]]) -> None:
        entries = [e for e in entries if not self._holds(e[0], e[1])]  # e.g. our own entry after a long stall
        tickets = [t for e in entries if (t := self._ticket(*e)) is not None]
        # Only a job that waited can have been cancelled while queued; sparing fresh ones the round trip keeps
        # an idle worker's admission fast, and the periodic cancel poll still catches a late flag.
        recent = time.time() - self.settings.cancel_poll_ms / 1000
        waited = [t for t in tickets if t.job.enqueued_at < recent]
        flags = {}
        if waited:
            ordered, replies = self._cancel_flags(waited, self.client)
            values = [flag for reply in replies for flag in reply]
            flags = dict(zip((t.key for t in ordered), values))
        for ticket in tickets:
            flag = flags.get(ticket.key)
            if flag is not None:
                self._answer(ticket, "cancelled", error="cancelled before it started")
            else:
                self.queue.push(ticket)

    def _reclaim_ms(self) -> int:
        return self.settings.reclaim_idle_ms if self.reclaim_due else 0

    def _ticket(self, stream: str, entry_id: str, fields: dict | None, deliveries: int) -> Ticket | None:
        payload = payload_of(fields)
        if deliveries > 1:
            self.metrics.on_redelivery()
        try:
            job = decode_job(payload)
        except ProtocolError as e:
            self._reject_raw(stream, entry_id, payload, str(e))
            return None
        ticket = Ticket(job, stream, entry_id, [], None, payload, attempt=max(1, deliveries))
        if deliveries > self.settings.max_deliveries:
            reason = f"delivered {deliveries} times, over max_deliveries={self.settings.max_deliveries}"
            self._answer(ticket, "error", error=reason, dead_reason=reason)
            return None
        if self.clock.expired(job, entry_id):
            self._answer(ticket, "expired", error="deadline passed before the job started")
            return None
        try:
            ticket.params = sampling_params(job.sampling)
            ticket.prompt_ids = prompt_ids(self.engine, job)
            self._clamp_budget(ticket)
            ticket.shared = self.engine.shared_prefix_tokens(ticket.prompt_ids, ticket.hashes)  # sizes later reads
            if (lane := self.affinity.lane_of(stream)) is not None:
                self.lane_prefixes.observe(lane, ticket.prompt_ids, ticket.tokens)
        except Exception as e:  # a tokenizer or chat template refusing this input is bad input, not a crash
            self._answer(ticket, "error", error=f"invalid job: {e}")
            return None
        return ticket

    def _clamp_budget(self, ticket: Ticket) -> None:
        """The engine never runs past max_model_len; a budget beyond it (max_tokens=1,000,000) would only skew
        the admission estimate and the fit check."""
        room = self.engine.max_model_len - len(ticket.prompt_ids)
        ticket.params.max_tokens = max(1, min(ticket.params.max_tokens, room))

    def _reject_raw(self, stream: str, entry_id: str, payload: bytes | None, reason: str) -> None:
        self.metrics.on_dead_letter("invalid")
        ident = identify(payload) if payload is not None else None
        if payload is None:
            reason = "entry has no payload (deleted or malformed stream fields)"
        if ident is None:
            self.publisher.dead_letter(stream, entry_id, reason, payload)
            return
        job_id, client_id, queued = ident
        final = Final(v=PROTOCOL_VERSION, job_id=job_id, status="error", error=reason, worker=self.worker_id,
                      timings=Timings(queued=queued, finished=time.time()), model=self.model)
        self.publisher.finish(Finish(final, client_id, stream, entry_id, dead_reason=reason, job_payload=payload))

    # ---- local queue -> engine -------------------------------------------------------------------
    def _admit_local(self) -> None:
        while (ticket := self.queue.head()) is not None and not self.draining:
            if self.clock.expired(ticket.job, ticket.entry_id):
                self.queue.pop()
                self._answer(ticket, "expired", error="deadline passed while waiting for KV cache room")
                continue
            if self.engine.has_unfinished() and not self._fits(ticket):
                return
            self.queue.pop()
            self._start(ticket)

    def _fits(self, ticket: Ticket) -> bool:
        shared = self.engine.shared_prefix_tokens(ticket.prompt_ids, ticket.hashes)
        return self.engine.fits(len(ticket.prompt_ids), ticket.params.max_tokens, shared)

    def _start(self, ticket: Ticket) -> None:
        try:
            if self.detok is None:
                self.engine.add_request(ticket.key, ticket.prompt_ids, ticket.params)
            else:
                self.engine.add_request(ticket.key, ticket.prompt_ids, ticket.params, detokenize=False)
                self.detok.add(ticket.key, ticket.params.stop, incremental=ticket.job.stream)
        except (RequestRejected, ValueError) as e:
            self._answer(ticket, "error", error=f"rejected: {e}")
            return
        now = time.time()
        self.flights[ticket.key] = Flight(ticket, now, logprobs=None if ticket.params.logprobs is None else [])
        self.metrics.on_admitted(max(0.0, now - ticket.job.enqueued_at))

    # ---- engine step -> outbox -------------------------------------------------------------------
    def _step(self) -> None:
        started = time.perf_counter()
        outputs = self.engine.step()
        self.metrics.on_step(self.engine.stats, time.perf_counter() - started, len(self.queue))
        now = time.time()
        if self.detok is not None:
            self._render_logprobs(outputs)
            self.detok.submit(outputs, now)
            return
        for out in outputs:
            flight = self.flights.get(out.request_id)
            if flight is not None:
                self._collect(flight, out, now)

    def _collect(self, flight: Flight, out: StepOutput, now: float) -> None:
        job = flight.ticket.job
        if out.new_token_ids and flight.first_token_at is None:
            flight.first_token_at = now
            self.metrics.on_first_token(now - flight.admitted_at)
        logprobs = None
        if flight.logprobs is not None and out.logprobs:
            logprobs = self.renderer.tokens(out.new_token_ids, out.logprobs, flight.ticket.params.logprobs)
            flight.logprobs.extend(logprobs)
        if job.stream and (out.new_token_ids or out.new_text):
            delta = Delta(PROTOCOL_VERSION, job.job_id, flight.deltas, out.new_text, list(out.new_token_ids),
                          attempt=flight.ticket.attempt, logprobs=logprobs)
            self.publisher.delta(job.client_id, delta, flight.ticket.key)
            flight.deltas += 1
        if out.finished:
            del self.flights[out.request_id]
            status = "cancelled" if out.finish_reason == "abort" else "done"
            self._answer(flight.ticket, status, out=out, flight=flight)

    def _render_logprobs(self, outputs: list[StepOutput]) -> None:
        """Logprobs are rendered as the tokens come (the engine's are per step); each text delta then takes
        those of its own tokens, in order."""
        for out in outputs:
            flight = self.flights.get(out.request_id)
            if flight is not None and flight.logprobs is not None and out.logprobs:
                flight.undecoded += self.renderer.tokens(out.new_token_ids, out.logprobs,
                                                         flight.ticket.params.logprobs)

    def _collect_text(self, lag: int) -> None:
        for step in self.detok.results(lag):
            for delta in step.deltas:
                flight = self.flights.get(delta.request_id)
                if flight is not None:
                    self._collect_delta(flight, delta, step)

    def _collect_delta(self, flight: Flight, d: TextDelta, step: StepText) -> None:
        """What the detokenizer made of a step: the same deltas and final `_collect` makes from text the engine
        decoded itself. A stop string found there ends the job here and the engine drops the request; the ids
        it generated past the stop meanwhile are not part of the result."""
        job = flight.ticket.job
        if d.token_ids and flight.first_token_at is None:
            flight.first_token_at = step.stamp
            self.metrics.on_first_token(step.stamp - flight.admitted_at)
        logprobs = None
        if flight.logprobs is not None:
            logprobs, flight.undecoded = flight.undecoded[:len(d.token_ids)], flight.undecoded[len(d.token_ids):]
            flight.logprobs.extend(logprobs)
        if job.stream and (d.token_ids or d.text):
            delta = Delta(PROTOCOL_VERSION, job.job_id, flight.deltas, d.text, list(d.token_ids),
                          attempt=flight.ticket.attempt, logprobs=logprobs or None)
            self.publisher.delta(job.client_id, delta, flight.ticket.key)
            flight.deltas += 1
        if not d.finished:
            return
        if flight.logprobs is not None:  # a job that does not stream gets its ids in one piece at the end
            flight.logprobs += flight.undecoded
            del flight.logprobs[len(d.output_ids or ()):]  # none for ids generated past a stop string
        del self.flights[d.request_id]
        out = step.outputs[d.request_id]
        if d.stopped:
            if not out.finished:
                self.engine.abort(d.request_id)
            status, reason = "done", "stop"
        else:
            reason = out.finish_reason
            status = flight.ending or ("cancelled" if reason == "abort" else "done")
        final = StepOutput(d.request_id, [], "", True, reason, out.prompt_tokens, len(d.output_ids or ()),
                           out.cached_tokens, token_ids=d.output_ids, text=d.output_text)
        self._answer(flight.ticket, status, out=final, flight=flight)

    def _answer(self, ticket: Ticket, status: str, *, out: StepOutput | None = None, flight: Flight | None = None,
                error: str | None = None, dead_reason: str = "") -> None:
        job = ticket.job
        timings = Timings(queued=job.enqueued_at, admitted=flight.admitted_at if flight else None,
                          first_token=flight.first_token_at if flight else None, finished=time.time())
        final = Final(v=PROTOCOL_VERSION, job_id=job.job_id, status=status, error=error, worker=self.worker_id,
                      timings=timings, metadata=job.metadata, attempt=ticket.attempt, model=self.model)
        if out is not None:
            final.text, final.token_ids = out.text or "", list(out.token_ids or [])
            final.finish_reason = out.finish_reason
            final.usage = Usage(out.prompt_tokens, out.output_tokens, out.cached_tokens)
            final.logprobs = flight.logprobs if flight is not None else None
        self.publisher.finish(Finish(final, job.client_id, ticket.stream, ticket.entry_id, dead_reason,
                                     ticket.payload if dead_reason else b""))
        if dead_reason:
            self.metrics.on_dead_letter("max_deliveries")

    def _flush(self) -> None:
        self._settle_exchange()
        self._settled(self.publisher.flush())

    def _exchange(self) -> None:
        """One round trip per step: the step's deltas and finals, the refill read for the slots it freed, and
        the cancellation poll when due. It runs on the I/O thread while the engine computes the next step, and
        its replies are taken in before the next one goes; with nothing to step, at once."""
        self._settle_exchange()
        if self.flights and time.monotonic() - self.renewed_at > 2 * self.settings.renew_interval_s:
            self._renew()  # we stalled (SIGSTOP, a slow step): check the leases before publishing for them
        pipe = self.client.pipeline(transaction=False)
        n_out = self.publisher.fill(pipe)
        told = self.affinity.tell(pipe, self._has_room()) if self.affinity.enabled and self.affinity.lanes else 0
        count, (lanes, held) = self._refill()
        reclaim_ms = self._reclaim_ms() if count else 0
        looked = 0
        if held:
            self._plan_held_read(lanes, held)
            self.reader.read(held, pipe)
        if count:
            self._plan_read(reclaim_ms)
            self.reader.read(count, pipe, reclaim_ms)
        if count or held:
            looked = self.affinity.look(pipe)
        polled = self._cancel_poll_due()
        polled, mgets = self._cancel_flags(polled, pipe) if polled else ([], [])
        if not (n_out or told or count or held or polled):
            return
        self.sent = Exchange(self.io.submit(self.publisher.round_trip, pipe), n_out, count, reclaim_ms, polled,
                             len(mgets), told, looked, held)
        if not self.engine.has_unfinished():
            self._settle_exchange()

    def _settle_exchange(self) -> None:
        sent, self.sent = self.sent, None
        if sent is None:
            return
        try:
            replies = sent.replies.result()
        except BaseException:
            self.publisher.requeue()
            raise
        self._settled(self.publisher.settle(replies[:sent.n_out]))
        error = next((r for r in replies[sent.n_out:] if isinstance(r, Exception)), None)
        if error is not None:
            raise error
        if sent.count or sent.held:
            at, reads = sent.n_out + sent.told, (sent.held > 0) + (sent.count > 0)
            if sent.looked:
                self.affinity.seen(replies[at + reads:at + reads + sent.looked])
            held = Reader.parse(replies[at]) if sent.held else []
            if sent.held and not held:
                self.held_dry_until = time.monotonic() + self.settings.affinity_steal_age_ms / 1000
            new = Reader.parse(replies[at + reads - 1]) if sent.count else []
            self._read_new(sent.count + sent.held, held + new, sent.reclaim_ms, drained=len(new) < sent.count)
        if sent.polled:
            self._cancel(sent.polled, [flag for reply in replies[-sent.n_polls:] for flag in reply])

    def _has_room(self) -> bool:
        """Whether a job of our lanes could start now; told to the others (Affinity.tell). Jobs just read wait in
        the local queue until the next admission pass: they count against the room, not as a sign of being full."""
        if self.draining:
            return False
        if not self.engine.has_unfinished() and not self.queue.tickets:
            return True
        adm = self.engine.admission()
        return self.queue.read_count(adm.free_seqs, adm.admissible_tokens, False) > 0

    def _refill(self) -> tuple[int, tuple[list, int]]:
        """Jobs to read in this step's round trip, and besides them, lanes whose prefix we hold with how many of
        their jobs fit in the room those leave (_held_lanes)."""
        if self.draining or not self.engine.has_unfinished() or any(c is not None for c in self.cursors.values()):
            return 0, ([], 0)
        wait_s = self.settings.busy_poll_ms / 1000 * 2 ** min(self.empty_reads, 3)
        if self.affinity.owned_count:  # look at our lanes at least once per steal age: their jobs wait for us that long
            wait_s = min(wait_s, self.settings.affinity_steal_age_ms / 1000)
        if time.monotonic() - self.last_read_empty_at < wait_s:
            return 0, ([], 0)
        adm = self.engine.admission()
        count = self.queue.read_count(adm.free_seqs, adm.admissible_tokens, False)
        return count, self._held_lanes(count, adm)

    def _held_lanes(self, count: int, adm) -> tuple[list, int]:
        """Lanes whose prefix running sequences hold, and how many of their jobs fit as tails in the room that
        `count` whole jobs leave: read apart from those, so they never claim room the whole-job read counts on. None
        while a job waits here (as for steals: a job read should start now)."""
        if not (self.affinity.enabled and self.affinity.lanes) or self.queue.tickets or count >= adm.free_seqs:
            return [], 0
        room = adm.admissible_tokens - count * max(self.queue.tokens_per_job, 1.0)
        cheapest = self.lane_prefixes.cheapest()
        if cheapest is None or room < cheapest or time.monotonic() < self.held_dry_until:
            return [], 0
        held = self.lane_prefixes.held(self.engine.shared_prefix_tokens)
        if not held:
            return [], 0
        n = min(adm.free_seqs - count, int(room // max(max(held.values()), 1.0)))
        return (sorted(held, key=held.get), n) if n > 0 else ([], 0)

    def _settled(self, settled: Settled) -> None:
        for finish, fresh in settled.answered:
            self.jobs_done += 1
            self.acked.add(finish.stream)
            if fresh:
                self._observe_finished(finish.final)
        for key, reason in settled.failed_jobs.items():
            self._fail_publishing(key, reason)
        for finish, reason in settled.failed_finishes:
            self._dead_letter_finish(finish, reason)

    def _fail_publishing(self, key: str, reason: str) -> None:
        """A delta this job's reply stream refused (a producer made its reply key another type): stop the job
        and answer it with the error; the finish script stores the result and dead-letters it with the reason."""
        flight = self.flights.pop(key, None)
        if flight is None:
            return
        self.publisher.forget({key})
        self.engine.abort(key)
        if self.detok is not None:
            self.detok.drop([key])
        reply = self.publisher.reply_of(flight.ticket.job.client_id, flight.ticket.stream)
        log.warning("job %s failed: its reply stream %s refused a delta: %s", flight.ticket.job.job_id, reply, reason)
        self._answer(flight.ticket, "error", flight=flight, error=f"could not publish to reply stream {reply}: {reason}")

    def _dead_letter_finish(self, finish: Finish, reason: str) -> None:
        why = f"final event could not be published: {reason}"
        log.error("job %s: %s", finish.final.job_id, why)
        try:
            self.publisher.dead_letter(finish.stream, finish.entry_id, why, finish.job_payload or None)
            self.metrics.on_dead_letter("publish")
        except redis.ResponseError as e:  # left pending: reclaimed later, dead-lettered at max_deliveries
            log.error("job %s: could not dead-letter it either: %s", finish.final.job_id, e)

    def _observe_finished(self, final: Final) -> None:
        t = final.timings
        tpot = None
        if t.first_token and final.usage.completion_tokens > 1:
            tpot = (t.finished - t.first_token) / (final.usage.completion_tokens - 1)
        self.metrics.on_finished(final.status, max(0.0, t.finished - t.queued), tpot, final.usage.prompt_tokens,
                                 final.usage.completion_tokens, final.usage.cached_tokens)

    # ---- housekeeping: leases, reclaim, cancellation, heartbeat, trim ---------------------------
    def _housekeep(self) -> None:
        s = self.settings
        if self.clock.due():
            self.clock.sync()
        if self._every("renew", s.renew_interval_s):
            self._renew()
        if not self.draining and self._every("reclaim", s.reclaim_interval_s):
            self.reclaim_due = True
        if self._every("heartbeat", s.heartbeat_interval_s):
            self._beat()
        if self._every("trim", s.trim_interval_s):
            self.trims += 1
            # Only streams with entries we acknowledged can have more to trim; all of them now and then, for
            # entries others acknowledged before leaving.
            trim(self.client, self.streams if self.trims % TRIM_ALL_EVERY == 0 else sorted(self.acked))
            self.acked.clear()
            if gone := self.consumers.prune():
                log.info("deleted %d departed consumers: %s", len(gone), ", ".join(gone))

    def _renew(self) -> None:
        """Renew our leases; a job whose lease is lost runs elsewhere now, so stop it and publish nothing more
        for it (a zombie resumed after a stall must not keep streaming for a job another worker finished)."""
        self.due["renew"] = time.monotonic() + self.settings.renew_interval_s
        lost = self.leases.renew(self._held_entries())
        self.renewed_at = time.monotonic()
        if not lost:
            return
        log.warning("%d jobs were taken over by another worker after a stall; stopping them here", len(lost))
        self.publisher.forget(lost)
        if self.detok is not None:
            self.detok.drop(lost)
        for key in lost:
            if self.flights.pop(key, None) is not None:
                self.engine.abort(key)
            elif (ticket := next((t for t in self.queue.tickets if t.key == key), None)) is not None:
                self.queue.remove(ticket)

    def _held_entries(self) -> dict[str, list[str]]:
        held: dict[str, list[str]] = {st: [] for st in self.streams}
        for ticket in [*(f.ticket for f in self.flights.values()), *self.queue.tickets]:
            held[ticket.stream].append(ticket.entry_id)
        return held

    def _cancel_poll_due(self) -> list[Ticket]:
        if not (self.flights or self.queue.tickets) or not self._every("cancel", self.settings.cancel_poll_ms / 1000):
            return []
        return [f.ticket for f in self.flights.values()] + list(self.queue.tickets)

    def _cancel(self, tickets: list[Ticket], flags: list) -> None:
        for ticket, flag in zip(tickets, flags):
            if flag is None:
                continue
            flight = self.flights.pop(ticket.key, None)
            if flight is None:
                if ticket in self.queue.tickets:
                    self.queue.remove(ticket)
                    self._answer(ticket, "cancelled", error="cancelled before it started")
                continue
            out = self.engine.abort(ticket.key)
            if self.detok is None:
                self._answer(ticket, "cancelled", out=out, flight=flight)
            elif out is not None:  # its text ends with what the detokenizer still holds: answer when it comes
                flight.ending, self.flights[ticket.key] = "cancelled", flight
                self.detok.submit([out], time.time())
            else:  # the engine finished it already; its final is being decoded
                self.flights[ticket.key] = flight

    def _beat(self) -> None:
        if not self.draining:
            self._sync_lanes()
        adm = self.engine.admission()
        self.heartbeat.beat(state="draining" if self.draining else "serving", stats=self.engine.stats,
                            admissible_tokens=adm.admissible_tokens, waiting=len(self.queue), jobs_done=self.jobs_done)

    # ---- drain ---------------------------------------------------------------------------------
    def _begin_drain(self) -> None:
        self.draining = True
        try:
            self.affinity.leave()
        except REDIS_DOWN:
            log.warning("could not leave the lane ring; our lanes move when our beat there expires")
        self.drain_deadline = time.monotonic() + self.settings.drain_timeout_s
        log.info("draining: %d running, %d queued locally; up to %.0fs", len(self.flights), len(self.queue),
                 self.settings.drain_timeout_s)
        handed = {st: [] for st in self.streams}
        while self.queue.tickets:
            ticket = self.queue.pop()
            handed[ticket.stream].append(ticket.entry_id)
        self._hand_back(handed)

    def _drained(self) -> bool:
        if self.flights and time.monotonic() < self.drain_deadline:
            return False
        self._redis(self._settle_exchange)  # what is on its way is sent or back in the outbox
        return not self.publisher.pending or time.monotonic() >= self.drain_deadline + 5

    def _finish_drain(self) -> None:
        handed = {st: [] for st in self.streams}
        for key, flight in list(self.flights.items()):
            self.engine.abort(key)
            handed[flight.ticket.stream].append(flight.ticket.entry_id)
        if self.detok is not None:
            self.detok.drop(list(self.flights))
        self.flights.clear()
        if any(handed.values()):
            log.info("drain timeout: handing back %d running jobs", sum(map(len, handed.values())))
        self._hand_back(handed)
        for _ in range(3):
            try:
                self._flush()
                self.heartbeat.stop()
                if kept := self.consumers.retire():
                    log.info("consumer %s kept in %s: entries handed back wait on it", self.worker_id, ", ".join(kept))
                break
            except REDIS_DOWN:
                time.sleep(0.5)
        self.io.shutdown(wait=False)
        if self.detok is not None:
            self.detok.close()
        self.client.close()
        log.info("worker %s stopped after %d jobs", self.worker_id, self.jobs_done)

    def _hand_back(self, handed: dict[str, list[str]]) -> None:
        if not any(handed.values()):
            return
        try:
            self.leases.hand_back(handed)
        except REDIS_DOWN:
            log.warning("could not hand back jobs; they return after the reclaim timeout")
