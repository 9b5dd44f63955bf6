"""Reading LoRA adapters from their folders off the worker's loop. An adapter is read into host memory on its first job
here (engine.loras: LoraSlots.read, then put); the read is the slow part of a load (safetensors from disk, checked
against the model), and on the loop it stopped every running sequence's steps for as long. A job whose adapter is not in
host memory waits in the local queue while a thread reads it (READERS at once), the jobs behind it passing; the running
batch steps on meanwhile, and the next admission pass puts the adapter in and starts the job. A read that fails is left
to the job's start, which reads again and answers the job with the error naming the file (one error path for both). With
nothing running, the loop waits for the read a little instead of spinning."""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from kvgate.engine.lora import LoraError

IDLE_WAIT_S = 0.02  # with nothing to step, how long an admission pass waits for a read before the loop goes on
READERS = 4  # adapters read at once: a worker new to a busy fleet reads one for each slot it fills, in parallel


class AdapterReads:
    def __init__(self, loras: Any) -> None:
        self.loras = loras  # the engine's LoraSlots
        self.reading: dict[str, Future] = {}  # adapter name -> its read on the thread
        self.pool: ThreadPoolExecutor | None = None  # made on the first read: most workers serve no adapter

    def ready(self, name: str | None, path: str | None, idle: bool) -> bool:
        """Whether a job of adapter `name` can start now as far as host memory goes: the base model's, an adapter
        known here, or one whose read ended (put in now; a failed one is the start's to answer). Otherwise its read
        is started or still running (`idle`: nothing runs, so wait for it a little)."""
        if name is None or name in self.loras:
            return True
        future = self.reading.get(name)
        if future is None:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(READERS, thread_name_prefix="kvgate-lora-read")
            future = self.reading[name] = self.pool.submit(self.loras.read, name, path)
        if idle:
            wait([future], timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        if not future.done():
            return False
        del self.reading[name]
        if future.exception() is None:
            try:
                self.loras.put(name, future.result())
            except LoraError:
                pass  # host memory full of adapters in use: the start adds it again and answers the job with that
        return True

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
