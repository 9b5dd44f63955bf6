"""Sharding a namespace over a Redis Cluster: every key of a shard carries the shard's hash tag, so each script
and each MULTI touches one slot, and the shards' slots are spread evenly over the 16,384 so that a cluster whose
primaries hold contiguous slot ranges (what `redis-cli --cluster create` makes) gets an even share of shards each.

A shard holds its job streams (every model, priority and lane), its reply streams (one per client and shard),
results, cancel flags, idempotency claims and dead letters: a job's whole life is in one slot, so the finish
script (result + reply + ack) stays atomic. A job's shard is the hash of its job id, or of its idempotency key
when it has one (so a resubmission meets the claim), and then its job id is drawn to hash to the same shard; with
fair share on, a job without one goes to the shard its producer deals it to (spread.py), its id drawn to hash there.
Names that describe the fleet (heartbeats, models, lanes, batches) live in shard 0.

On one Redis there is one shard and no tag: key names are what they always were.
"""
from __future__ import annotations

import zlib
from functools import lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

MAX_SHARDS = 1024


def shard_of(text: str, shards: int) -> int:
    """The shard a job id or idempotency key belongs to (CRC-32, unrelated to Redis's slot hash on purpose: the
    shard's tag decides the slot)."""
    return zlib.crc32(text.encode()) % shards if shards > 1 else 0


@lru_cache(maxsize=64)
def shard_tags(shards: int) -> tuple[str, ...]:
    """One hash tag per shard, shard k's slot inside the k-th of `shards` equal slices of the slot range."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards={shards} must be between 1 and {MAX_SHARDS}")
    width = REDIS_CLUSTER_HASH_SLOTS / shards
    tags = []
    for k in range(shards):
        n = 0
        while not k * width <= key_slot(f"{k}.{n}".encode()) < (k + 1) * width:
            n += 1
        tags.append(f"{k}.{n}")
    return tuple(tags)


def check_shards(shards: object) -> int:
    if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards={shards!r} must be a whole number from 1 to {MAX_SHARDS} (a few per primary: "
                         "a shard is one slot, so it can move to a new primary later, but never splits)")
    return shards
