"""Client: the synchronous producer SDK. Submit jobs, read their results and streamed tokens."""
from __future__ import annotations

import queue
import threading
from typing import Any, Iterable, Iterator

import redis

from .client_base import CHUNK, ClientBase, check_client_id  # noqa: F401 - check_client_id: kept importable here
from .connection import translated
from .durable import DurableSubmitter
from .errors import ResultTimeout
from .handle import JobHandle
from .job_status import JobStatus, job_states_script
from .keys import DEFAULT_MODEL
from .loras import Lora
from .queue_stats import QueueStats
from .redis_url import connect, keys_for
from .reply_reader import ReaderState, ReplyReader
from .request import submit_arguments, takes_submit_arguments
from .result import Result
from .steps import run
from .quotas import quota_scripts
from .submission import claim_script
from .tracing import enqueue_span


class Client(ClientBase):
    """A producer bound to one Redis namespace, with its own unguessable reply stream and reader thread. Its logic
    is ClientBase's steps, run here with blocking calls."""

    _handle_type = JobHandle

    def _open(self, namespace: str, reply_ttl_s: int) -> None:
        self._durable = DurableSubmitter.blocking(self.url, self.durability, self._failover_budget_s) \
            if self.durability.replicated else None
        self._changed = threading.Condition()
        self.redis = connect(self.url)
        with translated(self.url):
            self.keys = keys_for(self.url, self.redis, namespace)  # on a cluster: the namespace's shards
        self._script = claim_script(self.redis)
        self._quota_take, self._quota_release = quota_scripts(self.redis)
        self._states = job_states_script(self.redis)
        self._run(self._ensure_groups([DEFAULT_MODEL]))
        self._readers = []  # one per shard: a blocking read covers one slot
        for shard in range(len(self.keys.parts)):
            state = ReaderState(self.keys, self.client_id, self.router, reply_ttl_s=reply_ttl_s, shard=shard,
                                release=self._release_settled)
            conn = connect(self.url, socket_timeout=state.block_ms / 1000 + 10)
            self._readers.append(ReplyReader(conn, state, job_states_script(conn)))
            self._readers[-1].start()

    def _run(self, steps):
        with translated(self.url):
            return run(steps)

    # -- submitting -------------------------------------------------------------------------------
    @takes_submit_arguments
    def submit(self, prompt: str | None = None, **arguments) -> JobHandle:
        """Validate, then enqueue one job on its model's streams (`model=None`: the `default` model, which
        every worker serves unless told not to). Raises InvalidRequest before anything is enqueued. The keywords
        are SubmitRequest's: the sampling fields of wire.Sampling and the job's own (see help()); and `lora=NAME`, a
        registered LoRA adapter (the same as `model=NAME`, but refused at once when no adapter has that name)."""
        lora = arguments.pop("lora", None)
        with enqueue_span():  # the job's traceparent names it, where the caller traces with OpenTelemetry
            return self._run(self._submit(submit_arguments(self, prompt, arguments), lora))

    def submit_many(self, requests: Iterable[dict[str, Any]], progress: bool = False,
                    chunk_size: int | None = CHUNK, quota: bool = True) -> list[JobHandle]:
        """Validate every request (InvalidRequest names requests[i].field; each is submit's keywords, `lora` among
        them, as a dict), then admit them in chunks of
        `chunk_size` (at most max_backlog), each chunk whole or not at all: the backlog limit and the tenants'
        quotas for all its jobs, then one MULTI/EXEC (on a Redis Cluster one per shard, the others taken back when
        one fails). chunk_size=None: the whole call is one chunk. A chunk over a whole ceiling (more jobs than
        max_backlog or a tenant's max_jobs, more tokens than its tokens_per_minute) is an InvalidRequest; one the
        ceilings refuse for now a Backpressure or QuotaExceeded; Redis's refusal (ServerRefused: out of memory or
        read-only) a ServerRefused. In the first chunk nothing was enqueued; in a later one, PartiallySubmitted says
        which requests were enqueued (with their handles) and which were not. quota=False: past the client's tenant
        quotas (a caller that bounds its jobs otherwise, as the gateway's managed batches do with their window)."""
        with enqueue_span():
            return self._run(self._submit_many(requests, progress, chunk_size, quota))

    def embed(self, inputs: str | list[int] | list[str] | list[list[int]], *, model: str | None = None,
              pooling: str = "model", normalize: bool = True, dimensions: int | None = None,
              timeout: float | None = None, **arguments) -> list[list[float]]:
        """The embedding of each input (a string, or a prompt's token ids), in order: one job each (task embed),
        run as a prefill by a worker of `model`. pooling: model (the model's own), last, mean or cls; normalize: unit
        length; dimensions: keep the first N values. Other keywords are submit's (priority, ttl_s, tenant...).
        JobFailed names the first job that did not finish done; ResultTimeout after `timeout` seconds."""
        requests = self._embed_requests(inputs, {**arguments, "model": model, "pooling": pooling,
                                                 "normalize": normalize, "dimensions": dimensions})
        handles = self.submit_many(requests, chunk_size=None)  # one call, one admission: all its inputs or none
        deadline = self._deadline(timeout)
        return self._vectors([h.result(self._remaining(deadline)) for h in handles])

    # -- results ----------------------------------------------------------------------------------
    def get(self, job_id: str) -> Result | None:
        """The stored result of a finished job, or None while it runs (or after its result expired); see
        status() to tell those apart."""
        return self._run(self._get(job_id))

    def status(self, job_id: str) -> JobStatus:
        """Where a job is: queued, running (on which worker), finished, lost, or unknown. Exact for jobs this
        client submitted; for another job id, finished and running are found and the rest is 'unknown'."""
        return self._run(self._status(job_id))

    def cancel(self, job_id: str) -> None:
        self._run(self._cancel(job_id))

    def as_completed(self, handles: Iterable[JobHandle], timeout: float | None = None) -> Iterator[JobHandle]:
        """Yield handles as their jobs finish; ResultTimeout if `timeout` passes with some still running."""
        waiting = {h.job_id: h for h in handles}
        finished: queue.SimpleQueue[str] = queue.SimpleQueue()
        for h in waiting.values():
            self.router.when_final(h._box, lambda box: finished.put(box.job_id))
        deadline = self._deadline(timeout)
        while waiting:
            try:
                job_id = finished.get(timeout=self._remaining(deadline))
            except queue.Empty:
                raise ResultTimeout(next(iter(waiting)), timeout) from None
            if job_id in waiting:
                yield waiting.pop(job_id)

    def stats(self) -> QueueStats:
        return self._run(self._stats())

    # -- the fleet's LoRA adapters (producer/loras.py) ---------------------------------------------
    def add_lora(self, name: str, path: str, base: str) -> bool:
        """Register adapter `name` of model `base`, its PEFT folder at `path` on the workers; whether it was new."""
        return self._run(self._add_lora(name, path, base))

    def loras(self) -> dict[str, Lora]:
        """The registered adapters by name."""
        return self._run(self._loras())

    def remove_lora(self, name: str) -> bool:
        """Unregister an adapter (workers answer its waiting jobs with an error result); whether it was registered."""
        return self._run(self._remove_lora(name))

    # -- waiting ----------------------------------------------------------------------------------
    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _wait_until(self, predicate, timeout: float | None) -> bool:
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the reader and let the reply stream expire; results stay readable with Client.get."""
        if self._closed:
            return
        self._closed = True
        for reader in self._readers:
            reader.stop(self.redis)
        try:
            run(self._expire_replies())
        except redis.RedisError:
            pass
        self.redis.close()
        if self._durable is not None:
            run(self._durable.close())

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
