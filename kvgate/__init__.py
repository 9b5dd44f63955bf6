"""kvgate: asynchronous LLM inference, a fleet of continuous-batching workers behind Redis Streams.

    from kvgate import Client
    with Client("redis://localhost:6379/0") as client:
        print(client.submit("Hello!", max_tokens=32).result(timeout=60).text)

`import kvgate` is the SDK (redis, msgspec, pydantic), never torch; the engine is `kvgate.engine`.
"""
from importlib.metadata import PackageNotFoundError, version

from kvgate.producer import (AsyncClient, AsyncJobHandle, Backpressure, Client, ConnectionFailed, Delta, FieldError,
                             Final, IdempotencyConflict, InvalidRequest, JobHandle, JobLost, JobStatus, KvgateError,
                             PartiallySubmitted, PriorityStats, QueueStats, Quota, QuotaExceeded, Quotas, Restart,
                             Result, ResultTimeout, ServerRefused, Timings, Usage, WorkerStats)
from kvgate.producer import __all__ as _sdk_names

try:
    __version__ = version("kvgate")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [*_sdk_names, "__version__"]
