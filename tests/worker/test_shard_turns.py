"""On a Redis Cluster with fair share, a worker's one-shard reads take the shards in turn by the jobs each still
queues (worker/reader.py ShardTurns): the shards run dry together, the highest priority with jobs decides, and no
shard's turn falls below a quarter of an equal one."""
from __future__ import annotations

from kvgate.worker.shard_turns import ShardTurns


def turns_of(turns: ShardTurns, shards: list[int], n: int) -> dict[int, int]:
    got = {s: 0 for s in shards}
    for _ in range(n):
        got[turns.next(shards)] += 1
    return got


def test_shards_are_read_as_often_as_the_jobs_they_queue():
    turns = ShardTurns()
    turns.saw(0, {"normal": 300})
    turns.saw(1, {"normal": 100})
    turns.saw(2, {"normal": 200})
    assert turns_of(turns, [0, 1, 2], 600) == {0: 300, 1: 100, 2: 200}


def test_a_shard_not_yet_read_counts_as_the_fullest_and_none_with_jobs_means_equal_turns():
    turns = ShardTurns()
    turns.saw(0, {"normal": 30})
    assert turns_of(turns, [0, 1], 100) == {0: 50, 1: 50}  # shard 1 unseen: as full as shard 0
    turns = ShardTurns()
    turns.saw(0, {})
    turns.saw(1, {"normal": 0})
    assert turns_of(turns, [0, 1], 100) == {0: 50, 1: 50}


def test_the_highest_priority_with_jobs_decides_and_an_empty_shard_keeps_a_quarter_of_its_turn():
    turns = ShardTurns()
    turns.saw(0, {"low": 10_000})
    turns.saw(1, {"high": 40, "low": 0})
    got = turns_of(turns, [0, 1], 1000)
    # high: shard 1's 40 against shard 0's none, which keeps the floor (40 / (4 x 2) = 5): 40 to 5
    assert got == {0: 111, 1: 889}
    turns = ShardTurns()
    turns.saw(0, {"normal": 10_000})
    turns.saw(1, {"normal": 0})
    got = turns_of(turns, [0, 1], 1000)
    assert got[1] >= 1000 / 2 / 4 * 0.85  # a job that lands in the empty shard still finds about a quarter turn
