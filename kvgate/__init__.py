"""kvgate: asynchronous LLM inference, a fleet of continuous-batching workers behind Redis Streams.

    from kvgate import Client
    with Client("redis://localhost:6379/0") as client:
        print(client.submit("Hello!", max_tokens=32).result(timeout=60).text)

`import kvgate` is the SDK (redis, msgspec, pydantic), never torch; the engine is `kvgate.engine`.
"""
import os
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec

# A checkout run without an install (the offline GPU check: `python -m kvgate.bench.gpu_check_runner` from the
# root, the image's python and no build): the layers live in the root's engine/, kernels/, producer/ and worker/,
# which pyproject's package-dir installs as kvgate.<name>. With the root on this package's path they import under
# the same names; an install (a wheel, or an editable one) finds them itself and leaves the path alone.
if find_spec("kvgate.producer") is None:
    __path__.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
