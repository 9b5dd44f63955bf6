"""Which lanes' prefixes this worker holds: the leading tokens the jobs it read from each lane lately had in
common, and how many of them sit in KV blocks that running sequences hold now.

A job whose prefix the engine holds claims only its own tail of the KV cache, but a worker cannot see a job's
prompt before it reads it; with affinity lanes it knows the job's lane, and jobs of one lane mostly share one
prefix. So a worker whose room no longer fits a whole job can still read jobs of such a lane, sized by their
tails: a medium worker holds three times the jobs of one prefix that it holds of mixed ones.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Lane = tuple[str, int]  # (model, lane number), as in affinity.py
LANES_KEPT = 4  # lanes remembered, the most recently read: a worker holds the prefixes of only a few at once
MIN_SHARED_BLOCKS = 8  # shorter common prefixes save too little to size reads by (and scatter across lanes anyway)


@dataclass(slots=True)
class LanePrefix:
    ids: list[int]  # leading tokens every job read from the lane lately had, whole blocks only
    jobs: int = 1  # one job says nothing of what its lane shares: its own prompt is all held while it runs
    tail: float = 0.0  # running estimate of a job's tokens past `ids` (prompt and output budget)
    hashes: list[int] = field(default_factory=list)  # the engine's chained block hashes of `ids`, kept between looks


@dataclass(slots=True)
class LanePrefixes:
    block_size: int
    kept: dict[Lane, LanePrefix] = field(default_factory=dict)  # least recently read first

    def observe(self, lane: Lane, prompt_ids: list[int], tokens: int) -> None:
        """A job of `tokens` (prompt and output budget) read from `lane`: what the lane's jobs share shrinks to what
        this one has in common with them."""
        seen = self.kept.pop(lane, None)
        if seen is None:
            seen = LanePrefix(list(prompt_ids[:len(prompt_ids) // self.block_size * self.block_size]))
        else:
            n = common_blocks(seen.ids, prompt_ids, self.block_size) * self.block_size
            shrunk = n < len(seen.ids)
            if shrunk:
                del seen.ids[n:], seen.hashes[n // self.block_size:]
            sample = tokens - n
            seen.tail = sample if shrunk or seen.jobs == 1 else seen.tail + 0.2 * (sample - seen.tail)
            seen.jobs += 1
        self.kept[lane] = seen
        while len(self.kept) > LANES_KEPT:
            del self.kept[next(iter(self.kept))]

    def cheapest(self) -> float | None:
        """The smallest tail of a lane that shares a prefix: less room than this and no look at the cache pays."""
        tails = [p.tail for p in self.kept.values() if self._shares(p)]
        return min(tails) if tails else None

    def held(self, held_tokens: Callable[[list[int], list[int]], int]) -> dict[Lane, float]:
        """Lanes whose shared prefix (seen in two jobs at least) running sequences hold now, with the tokens one
        more of their jobs would claim: its tail, and the part of the prefix not held. `held_tokens(ids, hashes)` is
        the engine's shared_prefix_tokens."""
        out = {}
        for lane, prefix in self.kept.items():
            if not self._shares(prefix):
                continue
            # one token past the prefix: the engine counts only blocks a prompt runs beyond
            n = held_tokens(prefix.ids + [0], prefix.hashes)
            if n >= MIN_SHARED_BLOCKS * self.block_size:
                out[lane] = prefix.tail + len(prefix.ids) - n
        return out

    def _shares(self, prefix: LanePrefix) -> bool:
        return prefix.jobs >= 2 and len(prefix.ids) >= MIN_SHARED_BLOCKS * self.block_size


def common_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """Leading whole blocks `a` and `b` agree on."""
    n, end = 0, min(len(a), len(b)) // block_size * block_size
    while n < end and a[n:n + block_size] == b[n:n + block_size]:
        n += block_size
    return n // block_size
