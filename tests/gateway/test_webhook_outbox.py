"""The webhook outbox's scripts on a real Redis (kvgate/gateway/webhooks/outbox.py): a claimed event is hidden for its
claim lease and due again after it (a gateway that died mid-delivery), a retry is due after its backoff but never past
the retry time, past it the event is counted failed once; a background response's end writes one event however many
gateways see it; the backoff doubles up to its cap."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import redis
import redis.asyncio as aioredis

from kvgate.gateway.webhooks.outbox import Outbox, WebhookKeys, new_event, read_counts
from kvgate.gateway.webhooks.sender import MAX_BACKOFF_S, Timing
from tests.support import ROOT


def run(coro):
    return asyncio.run(coro)


async def with_outbox(url: str, ns: str, work):
    r = aioredis.Redis.from_url(url)
    try:
        return await work(Outbox(r, WebhookKeys(ns)), r)
    finally:
        await r.aclose()


async def add(outbox: Outbox, r, tenant: str = "default") -> str:
    """An event as a batch's transition writes it (the same Lua function)."""
    event_id, body = new_event("batch.completed", "batch_x", 1)
    script = r.register_script(outbox_add_script())
    await script(keys=[outbox.keys.event(event_id), outbox.keys.due], args=[event_id, body, tenant])
    return event_id


def outbox_add_script() -> str:
    from kvgate.gateway.webhooks.outbox import ADD

    return ADD + "add_event(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3]) return 1"


def test_a_claimed_event_is_hidden_for_its_lease_and_due_again_after_it(shared_redis, namespace):
    async def work(outbox: Outbox, r):
        event_id = await add(outbox, r, "team-a")
        _, (claimed,) = await outbox.claim(10, lease_ms=300)
        assert (claimed.id, claimed.tenant, claimed.attempts) == (event_id, "team-a", 1)
        assert json.loads(claimed.body)["type"] == "batch.completed"
        assert (await outbox.claim(10, lease_ms=300))[1] == []  # another gateway does not take it meanwhile
        await asyncio.sleep(0.4)
        _, (again,) = await outbox.claim(10, lease_ms=300)  # its claimer died: due again, one attempt more
        assert (again.id, again.attempts) == (event_id, 2)
        await outbox.done(event_id)
        assert (await outbox.claim(10, lease_ms=0))[1] == []
        assert not await r.exists(outbox.keys.event(event_id))

    run(with_outbox(shared_redis.url, namespace, work))
    with redis.Redis.from_url(shared_redis.url) as r:
        assert read_counts(r, WebhookKeys(namespace)).to_dict() == {"delivered": 1, "failed": 0, "dropped": 0,
                                                                    "pending": 0}


def test_a_retry_is_due_after_its_backoff_and_never_past_the_retry_time_then_failed_once(shared_redis, namespace):
    async def work(outbox: Outbox, r):
        event_id = await add(outbox, r)
        await outbox.claim(10, lease_ms=60_000)
        first = int(await r.hget(outbox.keys.event(event_id), "first"))
        assert await outbox.retry(event_id, backoff_ms=60_000, retry_ms=500, error="HTTP 503") == "retry"
        assert await r.zscore(outbox.keys.due, event_id) == first + 500  # capped: one last try at the end
        await asyncio.sleep(0.6)
        (_, due) = await outbox.claim(10, lease_ms=60_000)
        assert [e.id for e in due] == [event_id]
        assert await outbox.retry(event_id, backoff_ms=10, retry_ms=500, error="HTTP 503") == "failed"
        assert await outbox.retry(event_id, backoff_ms=10, retry_ms=500, error="HTTP 503") == "failed"  # counted once
        assert await r.zscore(outbox.keys.due, event_id) is None
        assert await r.zrange(outbox.keys.failed, 0, -1) == [event_id.encode()]
        assert await r.hget(outbox.keys.event(event_id), "error") == b"HTTP 503"
        assert 0 < await r.ttl(outbox.keys.event(event_id))

    run(with_outbox(shared_redis.url, namespace, work))
    with redis.Redis.from_url(shared_redis.url) as r:
        assert read_counts(r, WebhookKeys(namespace)).failed == 1


def test_a_background_responses_end_writes_one_event_however_many_gateways_see_it(shared_redis, namespace):
    async def work(outbox: Outbox, r):
        await outbox.watch("resp_1")
        seen = await asyncio.gather(*(outbox.response_ended("resp_1", "response.completed", "t", 5)
                                      for _ in range(5)))
        assert sorted(seen) == [False] * 4 + [True]
        _, (event,) = await outbox.claim(10, lease_ms=1000)
        body = json.loads(event.body)
        assert (body["type"], body["data"], body["created_at"], event.tenant) == ("response.completed",
                                                                                 {"id": "resp_1"}, 5, "t")
        assert await outbox.watched(10) == []

    run(with_outbox(shared_redis.url, namespace, work))


def test_the_backoff_doubles_from_its_first_delay_up_to_an_hour():
    t = Timing(retry_s=86_400, backoff_s=5, timeout_s=10, poll_s=1)
    assert [t.backoff_ms(a) for a in (1, 2, 3, 4)] == [5000, 10_000, 20_000, 40_000]
    assert t.backoff_ms(30) == MAX_BACKOFF_S * 1000


def test_kvgate_stats_reads_the_outbox_without_the_gateway_extra():
    """The SDK's install has no pydantic-settings or starlette: `kvgate stats` must not need them for its webhook line."""
    code = ("import sys, kvgate.commands.stats; "
            "assert not {'pydantic_settings', 'starlette', 'standardwebhooks'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_outbox_shares_the_batches_slot_on_a_redis_cluster():
    """A batch's transition writes its event in one script: every outbox key must be in the batch hash's slot."""
    from redis.crc import key_slot

    from kvgate.gateway.batches.batch_store import BatchStore
    from kvgate.producer.keys import Keys

    prefix = Keys("ns", shards=6, cluster=True).prefix
    store, hooks = BatchStore(aioredis.Redis(), prefix), WebhookKeys(prefix)
    slots = {key_slot(k.encode()) for k in (store.key("batch_x"), store.active_set, hooks.event("evt_1"), hooks.due,
                                           hooks.failed, hooks.counts, hooks.watch)}
    assert len(slots) == 1 and "{" in prefix
