"""Room in the engine for a job from the local queue: whether it fits beside what runs, and the one rule by which a
job may make room by preempting others (fair share, worker/fair.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from kvgate.producer.limits import DEFAULT_TENANT
from kvgate.worker.admission import Ticket
from kvgate.worker.clock import ServerClock, entry_ms
from kvgate.worker.engine import Engine
from kvgate.worker.fair import Fair, Occupancy
from kvgate.worker.flights import Flights

log = logging.getLogger("kvgate.worker")


@dataclass(slots=True)
class Room:
    engine: Engine
    flights: Flights
    fair: Fair
    clock: ServerClock
    preempt_ms: int  # worker settings' fair_preempt_ms (0: no job makes room)

    def fits(self, ticket: Ticket) -> bool:
        return self.engine.fits(len(ticket.prompt_ids), ticket.budget, self.shared(ticket))

    def shared(self, ticket: Ticket) -> int:
        """Its leading prompt tokens that running sequences hold. An embedding never reads the prefix cache, and a
        job asking for prompt logprobs computes its whole prompt: neither takes a prefix hit."""
        if ticket.pooling is None and ticket.params.prompt_logprobs is None:
            return self.engine.shared_prefix_tokens(ticket.prompt_ids, ticket.hashes)
        return 0

    def make(self, ticket: Ticket) -> bool:
        """Fair share: a job that waited preempt_ms (server clock), of a tenant that had few jobs waiting
        (Entry.may_preempt) and would stay within its share of the jobs running here, starts now, the youngest jobs of
        the tenants above theirs stepping aside down to it (preempted by recompute; they resume first), rather than
        waiting for room anywhere in the fleet (worker/fair.py). Whether it made room."""
        if not (self.preempt_ms and self.fair.active and ticket.may_preempt) or \
                self.clock.now() * 1000 - entry_ms(ticket.entry_id) < self.preempt_ms:
            return False
        band, tenant = self.fair.band_of_job(ticket.stream), ticket.job.tenant or DEFAULT_TENANT
        weights = self.fair.weights
        here = self.flights.occupancy(self.fair.band_of_job, weights).get(band, Occupancy(weights=weights))
        if not here.makes_room(tenant):
            return False
        victims = self.flights.youngest_first(here.over(tenant), band, self.fair.band_of_job)
        made = self.engine.make_room(len(ticket.prompt_ids), ticket.budget, self.shared(ticket), victims)
        if made:
            self.flights.stepped_aside(made)
            log.debug("%d jobs stepped aside for tenant %r's job %s", len(made), ticket.job.tenant, ticket.key)
        return made is not None
