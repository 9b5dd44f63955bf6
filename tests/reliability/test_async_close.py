"""AsyncClient.close ends its reader within about one blocking read, also right after a submit. redis-py turns
the cancellation of a blocking XREAD into its own error, which the reader's retry loop used to swallow: close
then never returned."""
from __future__ import annotations

import asyncio
import time

from kvgate.producer import AsyncClient


def test_async_close_returns_within_a_blocking_read_after_submits(redis_url, namespace):
    async def main() -> float:
        client = AsyncClient(redis_url, namespace)
        await client.start()
        await client.submit("hello", max_tokens=4)
        started = time.monotonic()
        await client.close()
        return time.monotonic() - started

    assert asyncio.run(main()) < 3.0
