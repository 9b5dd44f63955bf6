"""kvgate producer SDK: enqueue generation jobs on Redis Streams and read their results.

    from kvgate.producer import Client
    with Client("redis://localhost:6379/0") as client:
        print(client.submit("Hello!", max_tokens=32).result(timeout=60).text)

Importing this package never imports torch: the SDK is redis, msgspec, pydantic and tqdm only.
"""
from .async_client import AsyncClient, AsyncJobHandle
from .client import Client
from .errors import (Backpressure, ConnectionFailed, FieldError, IdempotencyConflict, InvalidRequest, JobFailed,
                     JobLost, KvgateError, NotReplicatedError, PartiallySubmitted, QuotaExceeded, ResultTimeout,
                     ServerRefused)
from .handle import JobHandle
from .job_status import JobStatus
from .protocol import Delta, Final, Timings, TokenLogprob, TopLogprob, Usage
from .queue_stats import PriorityStats, QueueStats, WorkerStats
from .quotas import Quota, Quotas
from .result import Result
from .stream import Restart

__all__ = [
    "Client", "AsyncClient", "JobHandle", "AsyncJobHandle", "Result", "Delta", "Restart", "Final", "Usage", "Timings",
    "TokenLogprob", "TopLogprob",
    "JobStatus", "JobLost", "JobFailed", "ServerRefused", "PartiallySubmitted",
    "QueueStats", "PriorityStats", "WorkerStats",
    "KvgateError", "InvalidRequest", "FieldError", "Backpressure", "IdempotencyConflict", "ResultTimeout",
    "ConnectionFailed", "NotReplicatedError", "QuotaExceeded", "Quota", "Quotas",
]
