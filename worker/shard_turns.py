"""On a Redis Cluster with fair share, the order in which one-shard reads take the shards (worker/reader.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.producer.keys import PRIORITIES


@dataclass(slots=True)
class ShardTurns:
    """On a Redis Cluster with fair share, which shard the next one-shard read looks at: in turn, each as often as
    the jobs queued in its fair bands of the highest priority that has any (as the last read of it saw them; one
    never read counts as the fullest), by smooth weighted round robin, so the shards run dry together. Read in equal
    turns, a shard that held more (a tenant alone for a moment drained the others first; a tenant served the more in
    the shards where its backlog was, once it ran out in others) kept its tenants' jobs to the end, when they sat in
    a few shards whose turns of the fleet's reads were less than their share (W-FAIR's last window on a cluster).
    Each shard gets at least a quarter of an equal turn, so a job that lands in an emptier shard waits at most
    about four times the turn it would have had."""

    queued: dict[int, dict[str, int]] = field(default_factory=dict)  # shard -> priority -> jobs queued there
    credit: dict[int, float] = field(default_factory=dict)

    def saw(self, shard: int, by_priority: dict[str, int]) -> None:
        self.queued[shard] = by_priority

    def weights(self, shards: list[int]) -> dict[int, float]:
        top = next((p for p in PRIORITIES if any(self.queued.get(s, {}).get(p) for s in shards)), None)
        if top is None:
            return {s: 1.0 for s in shards}
        known = {s: self.queued[s].get(top, 0) for s in shards if s in self.queued}
        fullest = max(known.values())
        each = {s: known.get(s, fullest) for s in shards}
        floor = max(1.0, sum(each.values()) / (4 * len(shards)))
        return {s: max(float(n), floor) for s, n in each.items()}

    def next(self, shards: list[int]) -> int:
        """The shard to read next among `shards` (in the order that breaks ties)."""
        weights = self.weights(shards)
        for s in shards:
            self.credit[s] = self.credit.get(s, 0.0) + weights[s]
        pick = max(shards, key=lambda s: self.credit[s])
        self.credit[pick] -= sum(weights.values())
        return pick
