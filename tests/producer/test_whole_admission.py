"""The SDK admits a chunk of jobs whole (issue 45.4): the backlog limit and the tenants' quotas for all of it, then one
enqueue, or none of it. A bulk submit_many's chunks are at most max_backlog, so it never passes the limit; a call with
chunk_size=None (what the gateway sends for a request, and embed) is one admission."""
from __future__ import annotations

import asyncio

import pytest

from kvgate.producer import AsyncClient, Client, InvalidRequest, PartiallySubmitted, Quota


def queued(redis_server, keys) -> int:
    r = redis_server.client()
    try:
        return sum(r.xlen(s) for s in keys.all_jobs(None))
    finally:
        r.close()


def test_a_bulk_submit_many_stops_at_max_backlog_and_says_what_was_enqueued(redis_url, redis_server, keys):
    with Client(redis_url, keys.ns, max_backlog=300) as client:
        with pytest.raises(PartiallySubmitted) as partly:
            client.submit_many([{"prompt": "x", "max_tokens": 1}] * 512)
        assert len(partly.value.handles) == 256 and partly.value.not_enqueued == list(range(256, 512))
        assert queued(redis_server, keys) == 256  # before: all 512, past the limit
        assert "backlog of 256 jobs plus the 256 of this call would pass max_backlog=300" in str(partly.value)


def test_one_admission_over_max_backlog_is_an_invalid_request_and_enqueues_nothing(redis_url, redis_server, keys):
    with Client(redis_url, keys.ns, max_backlog=300) as client:
        with pytest.raises(InvalidRequest) as e:
            client.submit_many([{"prompt": "x", "max_tokens": 1}] * 512, chunk_size=None)
        assert e.value.field == "requests" and "whole max_backlog=300" in str(e.value)
        assert queued(redis_server, keys) == 0


def test_embed_over_a_300_job_quota_enqueues_nothing(redis_url, redis_server, keys):
    async def main():
        async with AsyncClient(redis_url, keys.ns, quota=Quota(max_jobs=300)) as client:
            with pytest.raises(InvalidRequest, match="600 jobs of tenant 'default' in one admission"):
                await client.embed(["x"] * 600, timeout=5)  # before: PartiallySubmitted, 256 jobs left running

    asyncio.run(main())
    assert queued(redis_server, keys) == 0
