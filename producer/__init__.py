"""kvgate producer SDK: enqueue generation jobs on Redis Streams and read their results.

    from kvgate.producer import Client
    with Client("redis://localhost:6379/0") as client:
        print(client.submit("Hello!", max_tokens=32).result(timeout=60).text)

Importing this package never imports torch: the SDK is redis, msgspec, pydantic and tqdm only.
"""
from .async_client import AsyncClient, AsyncJobHandle
from .client import Client
from .errors import (Backpressure, ConnectionFailed, FieldError, IdempotencyConflict, InvalidRequest, KvgateError,
                     ResultTimeout)
from .handle import JobHandle
from .protocol import Delta, Final, Timings, Usage
from .queue_stats import PriorityStats, QueueStats, WorkerStats
from .result import Result

__all__ = [
    "Client", "AsyncClient", "JobHandle", "AsyncJobHandle", "Result", "Delta", "Final", "Usage", "Timings",
    "QueueStats", "PriorityStats", "WorkerStats",
    "KvgateError", "InvalidRequest", "FieldError", "Backpressure", "IdempotencyConflict", "ResultTimeout",
    "ConnectionFailed",
]
