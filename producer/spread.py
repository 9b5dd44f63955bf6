"""Where a fair-share job goes on a Redis Cluster: the shard where its tenant's backlog is shortest, as this producer
placed it.

Each shard's band keeps its own backlog of tenants and the workers read the shards in turn (worker/fair.py), so a
tenant served fairly drains its backlog in every shard at about the same pace, and the shard that held the least of
it runs dry first. From then on its jobs wait in fewer shards than the others' and the reads in turn give it less
than its share: the tail of its backlog (docs/tenants/fair-share.md). Placed by the hash of the job id, a tenant's 3,000
jobs of mixed lengths differ by 9-14% in tokens between its fullest shard and its emptiest: W-FAIR's last windows.
Dealt out by tokens instead, every shard holds the same to within one job.

A job with an idempotency key stays in the key's shard (a resubmission must meet its claim): only jobs without one
are dealt. Each producer deals its own jobs, so a tenant sent through several producers (gateway replicas) is
balanced to within one job each.
"""
from __future__ import annotations

import random
import threading
from collections import OrderedDict

TRACKED = 4096  # tenants' bands one producer remembers; the least recently used is forgotten (and starts again even)


class TenantSpread:
    """Per tenant and band (model and priority), the tokens (estimated: estimate_tokens) this producer put in each
    shard; `shard_for` picks the one with the fewest and counts the job there. Ties go round from a random shard, so
    short-lived producers that each send a few jobs do not all start in shard 0."""

    def __init__(self, shards: int, tracked: int = TRACKED):
        if shards < 2:
            raise ValueError(f"shards={shards}: spreading needs a cluster's shards (2 or more)")
        self.shards = shards
        self.tracked = tracked
        self._placed: OrderedDict[tuple[str, str, str], tuple[list[int], int]] = OrderedDict()
        self._lock = threading.Lock()  # one Client may submit from several threads

    def shard_for(self, tenant: str, model: str, priority: str, tokens: int) -> int:
        key = (tenant, model, priority)
        with self._lock:
            placed, first = self._placed.get(key) or ([0] * self.shards, random.randrange(self.shards))
            self._placed[key] = (placed, first)
            self._placed.move_to_end(key)
            if len(self._placed) > self.tracked:
                self._placed.popitem(last=False)
            shard = min(range(self.shards), key=lambda k: (placed[k], (k - first) % self.shards))
            placed[shard] += max(1, tokens)
            return shard

    def placed(self, tenant: str, model: str, priority: str) -> list[int]:
        """The tokens placed per shard (zeros for a band it does not remember)."""
        with self._lock:
            entry = self._placed.get((tenant, model, priority))
            return list(entry[0]) if entry else [0] * self.shards
