"""How many affinity lanes a namespace has, and whether it has fair share, as a producer sees them: `{ns}:lanes` and
`{ns}:fair`, re-read every few seconds.

A producer that has not seen the count yet (or reads it while Redis refuses) routes to the shared stream, which
every worker reads whatever its lanes: a stale count can delay affinity, never strand a job."""
from __future__ import annotations

import time
from dataclasses import dataclass

from .lanes import parse_lanes

REFRESH_S = 5.0


@dataclass(slots=True)
class LaneCount:
    every_s: float = REFRESH_S
    lanes: int = 0
    fair: bool = False  # jobs go to their tenant's stream (worker/fair.py); workers read the shared streams too
    _read_at: float = float("-inf")

    def stale(self) -> bool:
        return time.monotonic() - self._read_at >= self.every_s

    def record(self, raw, fair=None) -> int:
        self.lanes, self._read_at = parse_lanes(raw), time.monotonic()
        self.fair = fair is not None
        return self.lanes
