"""Dealing a fair-share tenant's jobs out over a cluster's shards (producer/spread.py): every shard gets the same
tokens of a tenant's band to within one job, tenants and bands apart, ties from a random shard, memory bounded."""
from __future__ import annotations

import random

import pytest

from kvgate.producer.spread import TenantSpread


def _sizes(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)  # W-FAIR's job mix: prompt 32-512 tokens, 16-192 generated
    return [rng.randint(32, 512) + rng.randint(16, 192) for _ in range(n)]


def test_a_tenants_jobs_weigh_the_same_in_every_shard_to_within_one_job():
    spread = TenantSpread(6)
    sizes = _sizes(3000, 0)
    for size in sizes:
        spread.shard_for("a", "m", "normal", size)
    placed = spread.placed("a", "m", "normal")
    assert sum(placed) == sum(sizes)
    assert max(placed) - min(placed) <= max(sizes), placed


def test_tenants_and_bands_are_dealt_apart():
    spread = TenantSpread(3)
    for _ in range(30):
        spread.shard_for("a", "m", "normal", 100)  # 1,000 tokens a shard
    assert spread.placed("a", "m", "normal") == [1000, 1000, 1000]
    assert spread.placed("b", "m", "normal") == spread.placed("a", "m", "high") == [0, 0, 0]
    shards = [spread.shard_for("b", "m", "normal", 5) for _ in range(3)]  # b's own even deal, whatever a's
    assert sorted(shards) == [0, 1, 2]


def test_fresh_producers_do_not_all_start_in_the_same_shard():
    firsts = {TenantSpread(6).shard_for("a", "m", "normal", 10) for _ in range(200)}
    assert len(firsts) >= 4  # 200 producers drawing the first of six shards: 3 or fewer has a chance below 1e-50


def test_it_remembers_a_bounded_number_of_tenants_the_least_recently_used_forgotten():
    spread = TenantSpread(2, tracked=3)
    for tenant in ("t0", "t1", "t2", "t3", "t4"):  # hostile producers' many tenants
        spread.shard_for(tenant, "m", "normal", 7)
    assert [sum(spread.placed(t, "m", "normal")) for t in ("t0", "t1", "t2", "t3", "t4")] == [0, 0, 7, 7, 7]
    spread.shard_for("t2", "m", "normal", 1)  # used again: t3 is now the oldest
    spread.shard_for("t5", "m", "normal", 1)
    assert sum(spread.placed("t3", "m", "normal")) == 0 and sum(spread.placed("t2", "m", "normal")) == 8


def test_a_zero_token_job_still_counts_and_one_shard_is_refused():
    spread = TenantSpread(2)
    assert sorted(spread.shard_for("a", "m", "normal", 0) for _ in range(2)) == [0, 1]
    with pytest.raises(ValueError, match="shards=1: spreading needs a cluster's shards"):
        TenantSpread(1)
