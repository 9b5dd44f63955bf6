"""The worker loop: admit jobs from Redis by KV capacity, step the engine, publish, renew, reclaim, drain.

One Worker owns one engine and its own Redis connection; several can run in threads of one process
(the fleet simulation) sharing nothing but Redis. The loop composes parts that each own their data: the refill
(what to read), the intake (entries -> tickets), the local admission queue, the flights (jobs in the engine),
cancellation, the publisher, leases; one pipeline per step carries what each of them sends (round_trip).
"""
from __future__ import annotations

import logging
import threading
import time

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvgate.producer.cluster import NodeLinks, is_noscript, scripts_lost
from kvgate.producer.urls import mask_url
from kvgate.producer.redis_url import FAILOVER_ERRORS, connect, keys_for
from kvgate.worker.admission import AdmissionQueue, Ticket
from kvgate.worker.affinity import Affinity, kv_weight, lane_lapse_ms
from kvgate.worker.answers import Answers
from kvgate.worker.cancellation import Cancellation
from kvgate.worker.clock import ServerClock, entry_ms
from kvgate.worker.consumers import Consumers
from kvgate.worker.engine import Engine
from kvgate.worker.fair import FAIR_FLUSH_S, Fair
from kvgate.worker.fair_sweep import SWEEP_AGAIN_S
from kvgate.worker.flights import Ended, Flights
from kvgate.worker.hand_back import HandBack
from kvgate.worker.heartbeat import Heartbeat, engine_capacity
from kvgate.worker.intake import Intake
from kvgate.worker.lane_prefixes import LanePrefixes
from kvgate.worker.leases import Leases, entries_of
from kvgate.worker.null_metrics import make_metrics
from kvgate.worker.publisher import Publisher, Settled
from kvgate.worker.refill import Capacity, Refill
from kvgate.worker.room import Room
from kvgate.worker.round_trip import RoundTrip
from kvgate.worker.adapters import Adapters
from kvgate.worker.served import served_models
from kvgate.worker.settings import WorkerSettings, default_worker_id
from kvgate.worker.tenant_load import TenantLoad
from kvgate.worker.tenant_weights import read_weights
from kvgate.worker.tracing import job_tracing
from kvgate.worker.trim import trim

log = logging.getLogger("kvgate.worker")
# ClusterError: a Redis Cluster with slots uncovered (a failover under way) or a node's connections exhausted
REDIS_DOWN = FAILOVER_ERRORS
TRIM_ALL_EVERY = 12  # trims: every 12th looks at every stream (a minute at the default trim_interval_s)


class Worker:
    def __init__(self, engine: Engine, settings: WorkerSettings, *, metrics=None, tracing=None):
        self.engine = engine
        self.settings = s = settings
        self.worker_id = s.worker_id or default_worker_id()
        self.served = served_models(engine.model_name, s.served_model_name, s.model_aliases, s.serve_default)
        self.model = self.served.canonical
        self.url = mask_url(s.redis_url)  # for messages: the password never reaches a log
        self.client = connect(s.redis_url, socket_timeout=s.block_ms / 1000 + 5, socket_connect_timeout=2,
                              retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 1))
        self.keys = keys_for(s.redis_url, self.client, s.namespace)  # on a cluster: learns the namespace's shards
        self.clock = ServerClock(self.client)
        self.metrics = metrics if metrics is not None else make_metrics(self.worker_id, self.model)
        self.adapters = Adapters(self.client, self.keys, engine, self.model, s, self.clock, self.metrics)
        self.streams = self.keys.served_jobs(names := [*self.served.names, *self.adapters.start(s.loras)])
        self.queue = AdmissionQueue(s.local_queue_size, float(s.initial_tokens_per_job))
        self.flights = Flights(engine, self.metrics, tracing or job_tracing(s.otel_endpoint, self.worker_id))
        self.publisher = Publisher(self.client, self.keys, s.result_ttl_s, s.reply_ttl_s, s.reply_maxlen,
                                   s.dead_maxlen, durability=s.replication,
                                   links=NodeLinks(self.client, s.redis_url) if self.keys.cluster and
                                   s.replication.replicated else None)
        self.leases = Leases(self.client, self.worker_id)
        self.hand_back = HandBack(self.client, self.keys, self.worker_id, s.hand_back_ms)
        self.consumers = Consumers(self.client, self.keys, self.worker_id, self.streams, s.reclaim_idle_ms)
        self.renewed_at = time.monotonic()
        self.affinity = Affinity(self.client, self.keys, self.worker_id, s.affinity == "on", s.affinity_lanes,
                                 s.heartbeat_ttl_s * 1000, weight=kv_weight(engine.stats.total_blocks),
                                 lapse_ms=lane_lapse_ms(s.reclaim_idle_ms, s.heartbeat_interval_s),
                                 models=names)
        self.lane_prefixes = LanePrefixes(engine.block_size)
        self.fair = Fair(self.client, self.keys, s.fair_share, set(self.streams))  # the bands: before lanes join
        self.room = Room(engine, self.flights, self.fair, self.clock, s.fair_preempt_ms)
        if s.tenant_weights is not None:
            self.fair.write_weights(read_weights(s.tenant_weights))
        self.refill = Refill(self.client, self.keys, self.worker_id, self.streams, s, engine, self.queue,
                             self.affinity, self.lane_prefixes, self.leases, self.clock, self.metrics,
                             len(names), self.fair, self.adapters.reads(self.served.names),
                             lambda: self.flights.occupancy(self.fair.band_of_job, self.fair.weights))
        self.intake = Intake(engine, self.clock, self.affinity, self.lane_prefixes, s.max_deliveries, self.metrics,
                             s.embeddings, s.tool_call_parser, self.adapters)
        self.cancellation = Cancellation(self.keys, s.cancel_poll_ms)
        self.tenant_load = TenantLoad()  # per tenant: running, tokens, queue wait, for the heartbeat
        self.answers = Answers(self.publisher, self.metrics, self.worker_id, self.model, self.fair, self.tenant_load,
                               self.flights.tracing)
        self.heartbeat = Heartbeat(self.client, self.keys, self.worker_id, self.model, self.served.heartbeat,
                                   engine_capacity(engine), s.heartbeat_ttl_s, engine.fim.family if engine.fim else "")
        self.due: dict[str, float] = {}
        self.offline_until, self.backoff_s, self.draining, self.drain_deadline, self.trims = 0.0, 0.05, False, 0.0, 0
        self.round_trip = RoundTrip(self.client, self.publisher, self.affinity, self.refill, self.cancellation)

    def use_queue(self, queue: AdmissionQueue) -> None:
        """Another local admission policy (the fleet benchmark's naive baseline), before run()."""
        self.queue = queue
        self.refill.use_queue(queue)

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
        if self.flights.decoding:
            # the text of the step before this one; all of it when nothing runs now, so nothing waits a step
            self.answers.publish(self.flights.collect(lag=1 if self.engine.has_unfinished() else 0))
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
            self._back_off()  # a lost XREADGROUP reply left entries pending to us
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):  # streams deleted or Redis restarted without persistence
                self._redis(self._ensure_groups)
                return
            if is_noscript(e):  # a cluster primary that never loaded our scripts (promoted, or new after a reshard)
                scripts_lost()
            # OOM, READONLY after a failover, BUSY script: the server's state, not ours; back off and retry
            log.error("redis refused a command: %s; retrying in %.2fs", e, self.backoff_s)
            self._back_off()  # a read in that pipeline may have delivered entries

    def _back_off(self) -> None:
        """Redis again after a while, longer each time; our own pending entries are read first then."""
        self.offline_until = time.monotonic() + self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, self.settings.max_backoff_s)
        self.refill.rewind(self.streams)

    def _ensure_groups(self) -> None:
        self.client.sadd(self.keys.models(), *self.served.names)  # listed by stats and the gateway from now on
        self._sync_lanes()
        self.consumers.create_groups(self.streams)

    def _sync_lanes(self) -> None:
        """Learn the namespace's lanes and our share; the streams we read only ever grow (nothing stranded). And
        whether it has fair share, with the tenants' weights."""
        self.fair.sync()
        names = self.adapters.sync(self.fair.active)  # adapters registered since: their bands, lanes, streams join ours
        self.fair.add_bands(self.keys.served_jobs(names))
        self.affinity.add_models(names)
        if self.affinity.sync() or names:
            self.refill.add_streams(self.consumers.add([s for s in self.affinity.streams() if s not in self.streams]))
        self.metrics.on_lanes(self.affinity.owned_count)

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
        own_pending = self.refill.own_pending
        if own_pending or idle:
            self._settle_exchange()  # a read of its own may be on its way: its entries come first
        if own_pending:
            for entries in self.refill.read_own_pending(count, self._holds):
                self._accept(entries)
        elif idle and not self.publisher.pending:
            if not self._accept(self.refill.read_idle(count)):
                self._accept(self.refill.read_blocking(count))
        # a busy engine is refilled by _exchange, in the same round trip as the step's publishing

    def _holds(self, stream: str, entry_id: str) -> bool:
        key = f"{stream}|{entry_id}"  # one we handed back is left to the read that takes it from the index
        return key in self.flights or any(t.key == key for t in self.queue.tickets) or key in self.hand_back.waiting

    def _accept(self, entries: list) -> int:
        """Queue the jobs read (their number is returned); answer those that cannot run, and those their client
        cancelled while they waited in Redis."""
        got = len(entries)
        self.hand_back.settle(f"{e.stream}|{e.entry_id}" for e in entries)  # ours handed back, taken back
        entries = [e for e in entries if not self._holds(e.stream, e.entry_id)]  # e.g. ours after a long stall
        tickets, rejections = self.intake.tickets(entries)
        for rejection in rejections:
            self.answers.reject(rejection)
        cancelled = self.cancellation.before_start(self.client, tickets)
        for ticket in tickets:
            if ticket.key in cancelled:
                self.answers.answer(Ended(ticket, "cancelled", error="cancelled before it started"))
            else:
                self.queue.push(ticket)
        return got

    # ---- local queue -> engine -> outbox -------------------------------------------------------
    def _admit_local(self) -> None:
        # one whose LoRA adapter is not ready (Flights.adapter_ready: read from disk, a slot) is passed over
        while (ticket := self.queue.head(self.flights.adapter_ready)) is not None and not self.draining:
            if self.clock.expired(ticket.job, ticket.entry_id):
                self.queue.remove(ticket)
                self.answers.answer(Ended(ticket, "expired", error="deadline passed while waiting for KV cache room"))
                continue
            ahead = False
            if self.engine.has_unfinished() and not self.room.fits(ticket):
                if self.room.make(ticket):
                    ahead = True
                elif self.hand_back.due(ticket) and self.hand_back.give_one(ticket):  # another's next read takes it
                    self.queue.remove(ticket)
                    continue
                else:
                    return
            self.queue.remove(ticket)
            if (refused := self.flights.start(ticket, ahead)) is not None:
                self.answers.answer(refused)
            else:  # the wait on the server's clock: its entry id is when Redis took the job
                self.tenant_load.admitted(ticket.job.tenant, self.clock.now() - entry_ms(ticket.entry_id) / 1000,
                                          time.monotonic())

    def _step(self) -> None:
        started = time.perf_counter()
        outputs = self.engine.step()
        self.metrics.on_step(self.engine.stats, time.perf_counter() - started, len(self.queue))
        self.flights.submit(outputs, time.time())

    # ---- the step's round trip -----------------------------------------------------------------
    def _exchange(self) -> None:
        """One round trip per step (round_trip.py), on the I/O thread while the engine computes the next step;
        with nothing to step, settled at once."""
        self._settle_exchange()
        if self.flights and time.monotonic() - self.renewed_at > 2 * self.settings.renew_interval_s:
            self._renew()  # we stalled (SIGSTOP, a slow step): check the leases before publishing for them
        holding = None
        if self.cancellation.due(bool(self.flights or self.queue.tickets)):
            holding = self.flights.tickets() + list(self.queue.tickets)
        # the room after the step, asked of the engine at most once: what we tell others and what we read spend it
        if self.round_trip.send(Capacity(self.engine), self.draining, holding) and not self.engine.has_unfinished():
            self._settle_exchange()

    def _settle_exchange(self) -> None:
        brought = self.round_trip.settle()
        if brought is None:
            return
        self._settled(brought.settled)
        if brought.error is not None:
            raise brought.error
        if brought.entries is not None:
            self._accept(brought.entries)
        if brought.flagged:
            self._cancel(brought.flagged)

    def _flush(self) -> None:
        self._settle_exchange()
        self._settled(self.publisher.flush())

    def _settled(self, settled: Settled) -> None:
        for key, reason in self.answers.settled(settled).items():
            self._fail_publishing(key, reason)

    def _fail_publishing(self, key: str, reason: str) -> None:
        """A delta this job's reply stream refused (a producer made its reply key another type): stop the job
        and answer it with the error; the finish script stores the result and dead-letters it with the reason."""
        flight = self.flights.fail(key)
        if flight is None:
            return
        self.publisher.forget({key})
        reply = self.publisher.reply_of(flight.ticket.job.client_id, flight.ticket.stream)
        log.warning("job %s failed: its reply stream %s refused a delta: %s", flight.ticket.job.job_id, reply, reason)
        self.answers.answer(Ended(flight.ticket, "error", flight=flight,
                                  error=f"could not publish to reply stream {reply}: {reason}"))

    def _cancel(self, flagged: list[Ticket]) -> None:
        for ticket in flagged:
            stopped = self.flights.cancel(ticket.key)
            if stopped is not None:
                self.answers.publish(stopped)
            elif ticket in self.queue.tickets:
                self.queue.remove(ticket)
                self.answers.answer(Ended(ticket, "cancelled", error="cancelled before it started"))

    # ---- housekeeping: leases, reclaim, heartbeat, trim ----------------------------------------
    def _housekeep(self) -> None:
        s = self.settings
        if self.clock.due():
            self.clock.sync()
        if self._every("renew", s.renew_interval_s):
            self._renew()
        if not self.draining and self._every("reclaim", s.reclaim_interval_s):
            self.refill.reclaim_soon()
        if self._every("heartbeat", s.heartbeat_interval_s):
            self._beat()
        if self._every("fair", FAIR_FLUSH_S):
            self.fair.flush()  # tenants' counters corrected by what their finished jobs really took
        if self._every("trim", s.trim_interval_s):
            self.trims += 1
            # Only streams with entries we acknowledged can have more to trim; all of them now and then, for
            # entries others acknowledged before leaving.
            acked = self.answers.take_acked()
            trim(self.client, self.streams if self.trims % TRIM_ALL_EVERY == 0 else acked)
            if gone := sorted(self.consumers.prune()):
                log.info("deleted %d departed consumers: %s", len(gone), ", ".join(gone))
        if self._every("sweep", s.trim_interval_s) and self.fair.prune(s.reclaim_idle_ms, self.worker_id):
            self.due["sweep"] = time.monotonic() + min(SWEEP_AGAIN_S, s.trim_interval_s)  # more due now (fair_sweep.py)

    def _renew(self) -> None:
        """Renew our leases; a job whose lease is lost runs elsewhere now, so stop it and publish nothing more
        for it (a zombie resumed after a stall must not keep streaming for a job another worker finished)."""
        self.due["renew"] = time.monotonic() + self.settings.renew_interval_s
        # with ours handed back and not yet taken, so no reclaim counts a delivery for them
        held = self.hand_back.add_to(entries_of(self.flights.tickets() + list(self.queue.tickets), self.streams))
        lost = self.hand_back.settle(self.leases.renew(held))  # one handed back and gone: another worker took it
        self.renewed_at = time.monotonic()
        if not lost:
            return
        log.warning("%d jobs were taken over by another worker after a stall; stopping them here", len(lost))
        self.publisher.forget(lost)
        self.queue.discard([key for key in lost if key not in self.flights])
        self.flights.lose(lost)

    def _beat(self) -> None:
        if not self.draining:
            self._sync_lanes()
            self.flights.adapter_reads.warm(self.adapters.to_read_ahead())  # none without adapters
        adm = self.engine.admission()
        self.heartbeat.beat(state="draining" if self.draining else "serving", stats=self.engine.stats,
                            admissible_tokens=adm.admissible_tokens, waiting=len(self.queue),
                            jobs_done=self.answers.jobs_done, loras=self.adapters.beat(),
                            tenants=self.tenant_load.snapshot((t.job.tenant for t in self.flights.tickets()),
                                                              time.monotonic()))

    # ---- drain ---------------------------------------------------------------------------------
    def _begin_drain(self) -> None:
        self.draining = True
        self.affinity.leave()
        self.drain_deadline = time.monotonic() + self.settings.drain_timeout_s
        log.info("draining: %d running, %d queued locally; up to %.0fs", len(self.flights), len(self.queue),
                 self.settings.drain_timeout_s)
        handed = self.hand_back.take_all(entries_of(self.queue.take_all(), self.streams))  # reclaimable at once too
        self.leases.hand_back(handed)

    def _drained(self) -> bool:
        if self.flights and time.monotonic() < self.drain_deadline:
            return False
        self._redis(self._settle_exchange)  # what is on its way is sent or back in the outbox
        return not self.publisher.pending or time.monotonic() >= self.drain_deadline + 5

    def _finish_drain(self) -> None:
        handed = entries_of(self.flights.stop_all(), self.streams)
        if any(handed.values()):
            log.info("drain timeout: handing back %d running jobs", sum(map(len, handed.values())))
        self.leases.hand_back(handed)
        for _ in range(3):
            try:
                self._flush()
                self.heartbeat.stop()
                if kept := self.consumers.retire():
                    log.info("consumer %s kept in %s: entries handed back wait on it", self.worker_id, ", ".join(kept))
                break
            except REDIS_DOWN:
                time.sleep(0.5)
        self.round_trip.close()
        self.flights.close()
        self.client.close()
        log.info("worker %s stopped after %d jobs", self.worker_id, self.answers.jobs_done)
