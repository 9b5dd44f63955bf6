"""AsyncClient has the Client's surface: await submit/result/get/cancel, async for stream."""
from __future__ import annotations

import asyncio

import pytest

from kvgate.producer import AsyncClient, ResultTimeout


def test_async_client_submits_streams_and_awaits_results(redis_url, namespace, worker):
    async def scenario():
        async with AsyncClient(redis_url, namespace) as client:
            handle = await client.submit("Hello", stream=True, max_tokens=4)
            loop = asyncio.get_running_loop()
            [job] = await loop.run_in_executor(None, worker.take)

            def play():
                worker.delta(job, 0, "Hel", [1])
                worker.delta(job, 1, "lo", [2])
                worker.final(job, text="Hello", token_ids=[1, 2])

            await loop.run_in_executor(None, play)
            texts = [d.text async for d in handle.stream(timeout=5)]
            result = await handle.result(timeout=5)
            stored = await client.get(handle.job_id)
            stats = await client.stats()
            return texts, result, stored, stats

    texts, result, stored, stats = asyncio.run(scenario())
    assert texts == ["Hel", "lo"] and result.text == "Hello" and stored.text == "Hello"
    assert stats.priorities["normal"].pending == 0


def test_async_result_times_out_and_cancel_sets_the_flag(redis_url, namespace, redis_server):
    async def scenario():
        async with AsyncClient(redis_url, namespace) as client:
            handle = await client.submit("x")
            with pytest.raises(ResultTimeout):
                await handle.result(timeout=0.2)
            await handle.cancel()
            return client.keys.cancel(handle.job_id)

    assert redis_server.client().get(asyncio.run(scenario())) == b"1"


def test_async_submit_sends_penalties_and_logprobs_and_the_result_carries_them(redis_url, namespace, worker):
    from kvgate.producer import TokenLogprob

    answer = [TokenLogprob(1, "Hi", b"Hi", -0.5)]

    async def scenario():
        async with AsyncClient(redis_url, namespace) as client:
            handle = await client.submit("Hello", max_tokens=1, logprobs=0, frequency_penalty=-2.0,
                                         presence_penalty=1.0)
            loop = asyncio.get_running_loop()
            [job] = await loop.run_in_executor(None, worker.take)
            await loop.run_in_executor(None, lambda: worker.final(job, text="Hi", token_ids=[1], logprobs=answer))
            return job.sampling, await handle.result(timeout=5)

    sampling, result = asyncio.run(scenario())
    assert (sampling.logprobs, sampling.frequency_penalty, sampling.presence_penalty) == (0, -2.0, 1.0)
    assert result.logprobs == answer


def test_async_idempotent_submits_enqueue_once_and_reuse_the_job(redis_url, namespace, redis_server):
    """An asyncio pipeline queues a script call only once it is awaited: before, idempotent submits enqueued
    nothing and returned no handles."""
    async def scenario():
        async with AsyncClient(redis_url, namespace) as client:
            first = await client.submit("once", idempotency_key="async-1")
            again = await client.submit("once", idempotency_key="async-1")
            many = await client.submit_many([{"prompt": "a", "idempotency_key": "async-2"},
                                             {"prompt": "a", "idempotency_key": "async-2"}])
            return first, again, many, client.keys

    first, again, many, keys = asyncio.run(scenario())
    assert again.job_id == first.job_id and len(many) == 2 and many[0].job_id == many[1].job_id
    assert redis_server.client().xlen(keys.jobs(None, "normal")) == 2
