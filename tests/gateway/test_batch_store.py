"""Batch state in Redis: status moves only from allowed states, lines count once, one lease holder at a time."""
from __future__ import annotations

import asyncio
import time

from kvgate.gateway.batches.batch_store import Batch, BatchStore, new_batch_id


def run(shared_redis, namespace, body):
    import redis.asyncio as aioredis

    async def main():
        r = aioredis.Redis.from_url(shared_redis.url)
        try:
            return await body(BatchStore(r, namespace))
        finally:
            await r.aclose()

    return asyncio.run(main())


def new_batch() -> Batch:
    now = int(time.time())
    return Batch(new_batch_id(), "/v1/chat/completions", "file-x", now, now + 60, metadata={"k": "v"})


def test_a_batch_round_trips_in_openais_shape(shared_redis, namespace):
    async def body(store: BatchStore):
        b = new_batch()
        await store.create(b)
        return b, await store.get(b.id), await store.active()

    created, read, active = run(shared_redis, namespace, body)
    assert read == created and active == [created.id]
    shape = read.body()
    assert shape["object"] == "batch" and shape["status"] == "validating" and shape["metadata"] == {"k": "v"}
    assert shape["request_counts"] == {"total": 0, "completed": 0, "failed": 0} and shape["errors"] is None


def test_status_moves_only_from_the_allowed_states_and_a_final_one_leaves_the_active_set(shared_redis, namespace):
    async def body(store: BatchStore):
        b = new_batch()
        await store.create(b)
        moved = [await store.transition(b.id, ("validating",), "in_progress", in_progress_at=1, total=3),
                 await store.transition(b.id, ("validating", "in_progress"), "cancelling", cancelling_at=2),
                 # the runner finishing after the cancel must not overwrite it
                 await store.transition(b.id, ("in_progress",), "finalizing", finalizing_at=3),
                 await store.transition(b.id, ("cancelling",), "cancelled", cancelled_at=4)]
        return moved, await store.get(b.id), await store.active()

    moved, b, active = run(shared_redis, namespace, body)
    assert moved == [True, True, False, True]
    assert (b.status, b.in_progress_at, b.cancelling_at, b.finalizing_at, b.cancelled_at) == ("cancelled", 1, 2,
                                                                                               None, 4)
    assert b.total == 3 and active == []


def test_a_line_is_recorded_and_counted_once_and_only_while_the_batch_runs(shared_redis, namespace):
    async def body(store: BatchStore):
        b = new_batch()
        await store.create(b)
        early = await store.record(b.id, "a", {"custom_id": "a", "error": None}, ok=True)  # still validating
        await store.transition(b.id, ("validating",), "in_progress")
        first = await store.record(b.id, "a", {"custom_id": "a", "error": None}, ok=True)
        again = await store.record(b.id, "a", {"custom_id": "a", "error": None}, ok=True)
        await store.record(b.id, "b", {"custom_id": "b", "error": {"code": "x"}}, ok=False)
        await store.transition(b.id, ("in_progress",), "completed")
        late = await store.record(b.id, "c", {"custom_id": "c", "error": None}, ok=True)
        return early, first, again, late, await store.get(b.id), await store.answered(b.id)

    early, first, again, late, b, answered = run(shared_redis, namespace, body)
    assert (early, first, again, late) == (False, True, False, False)
    assert (b.completed, b.failed) == (1, 1) and answered == {"a", "b"}


def test_one_lease_holder_at_a_time_and_only_the_holder_renews_or_releases(shared_redis, namespace):
    async def body(store: BatchStore):
        got = [await store.acquire("batch_1", "me", 5), await store.acquire("batch_1", "you", 5)]
        renewed = [await store.renew("batch_1", "you", 5), await store.renew("batch_1", "me", 5)]
        await store.release("batch_1", "you")
        still_held = await store.acquire("batch_1", "you", 5)
        await store.release("batch_1", "me")
        return got, renewed, still_held, await store.acquire("batch_1", "you", 0.05)

    got, renewed, still_held, after_release = run(shared_redis, namespace, body)
    assert got == [True, False] and renewed == [False, True] and still_held is False and after_release is True


def test_pages_go_newest_first_and_continue_after_the_last_id(shared_redis, namespace):
    async def body(store: BatchStore):
        ids = []
        for _ in range(5):
            b = new_batch()
            await store.create(b)
            ids.append(b.id)
        first, more = await store.page(2, None)
        second, more2 = await store.page(2, first[-1].id)
        last, more3 = await store.page(2, second[-1].id)
        return ids, [b.id for b in first + second + last], (more, more2, more3)

    ids, paged, mores = run(shared_redis, namespace, body)
    assert paged == ids[::-1] and mores == (True, True, False)
