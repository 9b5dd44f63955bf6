"""What one read looks at and how: the streams in order and the rules of the features that shape it (affinity lanes,
fair share, hand-back). Made by `Affinity.read_plan` (lanes) or the refill, sized by the worker's room; the reader
(reader.py) turns it into each shard's read script inputs."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.worker.fair import Occupancy, kin_of, shares_read_inputs, tenants_read_inputs


@dataclass(slots=True)
class ReadPlan:
    """Which streams one read looks at and how (with lanes: made by `Affinity`, sized by the worker's refill)."""

    streams: list[str]  # priority by priority
    home: int | None = None  # with lanes: streams[:home] are ours, the rest are read only when ripe (stealing)
    urgent: int = 0  # with lanes: streams[home:home + urgent] are full owners' lanes, read without waiting to ripen
    overdue: list[str] = field(default_factory=list)  # others' lanes to check for overdue entries on this read
    overdue_ms: int = 0  # 0: never take others' entries before our own
    steal_max: int = 1  # entries one read may take from others' lanes
    fair: set[str] = field(default_factory=set)  # fair share: band streams whose tenants' streams are read after them
    charge: float = 1.0  # fair share: tokens a job read is charged (corrected when it ends)
    weights: dict[str, float] = field(default_factory=dict)  # fair share: tenant -> weight, where not 1
    preempt_ms: int = 0  # fair share, >0: a full worker's preempting look, for a job waiting this long (worker/fair.py)
    handed: bool = True  # takes jobs workers handed back first (worker/hand_back.py); not a read of tails that fit
    # fair share, that look: per band, what the worker runs there (worker/fair.py), for the bands it may preempt in
    occupancy: dict[str, Occupancy] = field(default_factory=dict)
    per_priority: int = 0  # without lanes: streams of each priority (the models read); 0: the reader's own count

    def urgent_streams(self) -> list[str]:
        return self.streams[self.home:self.home + self.urgent] if self.home is not None else []

    def lane_of(self, index: int) -> str:
        """The lane kind of `streams[index]` as the read script takes it (affinity.py's LANES_READ_LUA)."""
        if self.home is None or index < self.home:
            return "own"
        return "urgent" if index < self.home + self.urgent else "other"

    def by_backlog(self) -> bool:
        """Whether a cluster read takes the shards by their tenants' backlogs (ShardTurns): fair share, not a
        preempting look."""
        return bool(self.fair) and not self.preempt_ms

    def tenants_inputs(self, stream: str, add_key) -> dict | None:
        """A band stream's tenants part of the read script's inputs (fair.py); None for a stream that is no band."""
        if stream not in self.fair:
            return None
        return tenants_read_inputs(stream, self.occupancy.get(stream), add_key, self._left_out_kin(stream))

    def _left_out_kin(self, band: str) -> list[str]:
        """The bands of `band`'s kin (fair.py) this read leaves out (LoRA adapters without room here), named beside
        the first band of its kin that the read looks at (by name): their tenants' counters move with the others'."""
        kin = kin_of(band)
        read = [b for b in self.streams if b in self.fair and kin_of(b) == kin]
        if band != min(read, default=band):
            return []
        return sorted(b for b in self.fair if kin_of(b) == kin and b not in read)

    def shares_inputs(self) -> dict | None:
        """Fair share's settings for the read script (fair.py); None without it."""
        return shares_read_inputs(self.charge, self.preempt_ms, self.weights) if self.fair else None
