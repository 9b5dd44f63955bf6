"""Reading LoRA adapters from their folders off the worker's loop. An adapter is read into host memory on its first job
here (engine.loras: LoraSlots.read, then put); the read is the slow part of a load (safetensors from disk, checked
against the model), and on the loop it stopped every running sequence's steps for as long. A job whose adapter is not in
host memory waits in the local queue while a thread reads it (READERS at once), the jobs behind it passing; the running
batch steps on meanwhile, and the next admission pass puts the adapter in and starts the job. A read that fails is left
to the job's start, which reads again and answers the job with the error naming the file (one error path for both). With
nothing running, the loop waits for the read a little instead of spinning.

Adapters are also read ahead (`warm`): each heartbeat, the adapters not in host memory whose jobs wait in Redis, most
jobs first, WARM_READS at a time and only while no job here waits for a read and host memory has room without evicting
one. A job of such an adapter then waits for a copy into a slot, not a read from disk: in W-LORA's fleet a tenth of
the running sequences stood idle mid-run behind reads of adapters new to their worker. A read ahead that fails is not
tried ahead again (a job of that adapter still reads it, and its start answers it with the error)."""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from kvgate.engine.lora import LoraError

IDLE_WAIT_S = 0.02  # with nothing to step, how long an admission pass waits for a read before the loop goes on
READERS = 4  # adapters read at once: a worker new to a busy fleet reads one for each slot it fills, in parallel
WARM_READS = 2  # adapters read ahead at once: the other readers stay free for the jobs here


class AdapterReads:
    def __init__(self, loras: Any) -> None:
        self.loras = loras  # the engine's LoraSlots
        self.reading: dict[str, Future] = {}  # adapter name -> its read on the thread
        self.pool: ThreadPoolExecutor | None = None  # made on the first read: most workers serve no adapter
        self.ahead: set[str] = set()  # reads started by `warm`, no job asking for them yet
        self.failed_ahead: set[str] = set()  # read ahead and failed: not tried ahead again

    def ready(self, name: str | None, path: str | None, idle: bool) -> bool:
        """Whether a job of adapter `name` can start now as far as host memory goes: the base model's, an adapter
        known here, or one whose read ended (put in now; a failed one is the start's to answer). Otherwise its read
        is started or still running (`idle`: nothing runs, so wait for it a little)."""
        if name is None or name in self.loras:
            return True
        self.ahead.discard(name)  # a job asks for it now: its failure is that job's to answer
        future = self.reading.get(name) or self._start(name, path)
        if idle:
            wait([future], timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        if not future.done():
            return False
        self._put(name)
        return True

    def warm(self, adapters: list[tuple[str, str]]) -> list[str]:
        """Read ahead (name, folder) adapters, most wanted first (the module docstring's rule); the names whose read
        started now."""
        for name in [n for n in self.ahead if self.reading[n].done()]:
            self._put(name)
        if len(self.ahead) < len(self.reading):  # a job waits for a read: the readers are its
            return []
        limit = self.loras.max_cpu_loras
        room = WARM_READS - len(self.reading)
        if limit is not None:
            room = min(room, limit - len(self.loras.adapters) - len(self.reading))
        started: list[str] = []
        for name, path in adapters:
            if len(started) >= room:
                break
            if name not in self.loras and name not in self.reading and name not in self.failed_ahead:
                self._start(name, path)
                self.ahead.add(name)
                started.append(name)
        return started

    def _start(self, name: str, path: str | None) -> Future:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(READERS, thread_name_prefix="kvgate-lora-read")
        future = self.reading[name] = self.pool.submit(self.loras.read, name, path)
        return future

    def _put(self, name: str) -> None:
        """A finished read into host memory (a failed one: left to the job's start, or not tried ahead again)."""
        future = self.reading.pop(name)
        if name in self.ahead:
            self.ahead.discard(name)
            if future.exception() is not None:
                self.failed_ahead.add(name)
                return
        if future.exception() is None:
            try:
                self.loras.put(name, future.result())
            except LoraError:
                pass  # host memory full of adapters in use: the start adds it again and answers the job with that

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
