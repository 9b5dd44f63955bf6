"""Answering jobs: each final event built and put in the outbox, rejections answered (or dead-lettered when
nobody can be told), and what became of the finals once the outbox went out."""
from __future__ import annotations

import time
from typing import Any

from kvgate.producer.protocol import PROTOCOL_VERSION, Final, Timings
from kvgate.worker.fair import Fair
from kvgate.worker.flights import Collected, Ended, final_of, observe_finished
from kvgate.worker.intake import Rejection, identify
from kvgate.worker.publisher import Finish, Publisher, Settled
from kvgate.worker.tenant_load import TenantLoad
from kvgate.worker.tracing import JobTracing, NoTracing


class Answers:
    def __init__(self, publisher: Publisher, metrics: Any, worker_id: str, model: str, fair: Fair | None = None,
                 load: TenantLoad | None = None, tracing: JobTracing | NoTracing | None = None) -> None:
        self.publisher, self.metrics, self.worker_id, self.model = publisher, metrics, worker_id, model
        self.tracing = tracing or NoTracing()
        self.fair, self.load = fair, load
        self.jobs_done = 0
        self.acked: set[str] = set()  # streams we acknowledged entries of since the last trim

    def answer(self, ended: Ended) -> None:
        t = ended.ticket
        final = final_of(ended, worker=self.worker_id, model=t.lora or self.model, finished_at=time.time())
        self.publisher.finish(Finish(final, t.job.client_id, t.stream, t.entry_id, ended.dead_reason,
                                     t.payload if ended.dead_reason else b"", tenant=t.job.tenant))
        if ended.dead_reason:
            self.metrics.on_dead_letter("max_deliveries")

    def publish(self, collected: Collected) -> None:
        for delta in collected.deltas:
            self.publisher.delta(*delta)
        for ended in collected.ended:
            self.answer(ended)

    def reject(self, r: Rejection) -> None:
        if r.ticket is not None:
            self.answer(Ended(r.ticket, r.status, error=r.error or None, dead_reason=r.dead_reason,
                              tokenized=r.tokenized))
            return
        self.metrics.on_dead_letter(r.dead_label)
        ident = identify(r.payload) if r.payload is not None else None
        if ident is None:
            self.publisher.dead_letter(r.stream, r.entry_id, r.error, r.payload)
            return
        job_id, client_id, queued = ident
        final = Final(v=PROTOCOL_VERSION, job_id=job_id, status=r.status, error=r.error, worker=self.worker_id,
                      timings=Timings(queued=queued, finished=time.time()), model=self.model)
        self.publisher.finish(Finish(final, client_id, r.stream, r.entry_id, dead_reason=r.error,
                                     job_payload=r.payload))

    def settled(self, settled: Settled) -> dict[str, str]:
        """Count what was answered and dead-letter the finals the script refused; the jobs whose deltas a reply
        stream refused (request key -> why), for the caller to stop."""
        for finish, fresh in settled.answered:
            self.jobs_done += 1
            self.acked.add(finish.stream)
            if fresh:
                observe_finished(self.metrics, finish.final, finish.tenant)
                self.tracing.answered(finish.final)
                usage = finish.final.usage
                if self.load is not None:
                    self.load.finished(finish.tenant, usage.prompt_tokens + usage.completion_tokens, time.monotonic())
                if self.fair is not None:
                    self.fair.finished(finish.stream, finish.entry_id, finish.tenant,
                                       usage.prompt_tokens + usage.completion_tokens)
        for finish, reason in settled.failed_finishes:
            if self.publisher.dead_letter_finish(finish, reason):
                self.metrics.on_dead_letter("publish")
        return settled.failed_jobs

    def take_acked(self) -> list[str]:
        acked, self.acked = sorted(self.acked), set()
        return acked
