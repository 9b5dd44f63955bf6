"""Which adapters the engine knows (host memory) and which its device slots hold, decided between steps.

The rule, in one place (`can_acquire`): a sequence of adapter X starts only when X is in a slot already, a slot is
free, or a slot holds an adapter no running sequence uses (the least recently used such slot is overwritten). When
none is, the sequence waits at the head of the queue, as it would for KV blocks, until a running sequence of
another adapter finishes; a running sequence's adapter is never evicted. Preempting a sequence unpins its adapter
(it stays loaded: the sequence resumes first and finds it). Host memory keeps at most `max_cpu_loras` adapters
(unset: all): adding one more drops the least recently added one that no queued request names, or refuses.

Each `add` gives the adapter a fresh prefix-cache seed (block_manager: a sequence's chained block hashes start from
it), so two adapters, the base model and an adapter re-added with new weights under its old name never share a KV
block. Torch-free: the device copy is the runner's LoraModel (engine/lora_layers.py), reached through `device`."""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from typing import Any

from kvgate.engine.lora import LoraError
from kvgate.engine.outputs import RequestRejected
from kvgate.engine.sequence import Sequence

_generations = itertools.count()


class LoraSlots:
    def __init__(self, max_loras: int, max_cpu_loras: int | None, device: Any = None) -> None:
        self.device = device  # the runner's LoraModel: read(name, path) -> adapter, load(slot, adapter)
        self.max_cpu_loras = max(max_cpu_loras, max_loras) if max_cpu_loras else None
        self.adapters: OrderedDict[str, Any] = OrderedDict()  # host copies, oldest first
        self.seeds: dict[str, int] = {}
        self.slots: list[str | None] = [None] * max_loras
        self.idle: OrderedDict[int, None] = OrderedDict()  # loaded slots no running sequence uses, LRU first
        self.running: Counter[str] = Counter()  # running sequences per adapter: their slot is pinned
        self.queued: Counter[str] = Counter()  # sequences per adapter in the scheduler, waiting or running
        self.loads = self.evictions = 0

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    @property
    def loaded(self) -> dict[str, int]:
        return {name: slot for slot, name in enumerate(self.slots) if name is not None}

    # ---- the host registry ----------------------------------------------------------------------------------

    def add(self, name: str, path: str) -> None:
        """Read and check the adapter at `path` (LoraError naming the file and the problem) and serve it as `name`."""
        self._check_serving(name)
        self._check_unused(name)  # before the read: an adapter in use is refused without touching its folder
        self.put(name, self.device.read(name, path))

    def read(self, name: str, path: str) -> Any:
        """The adapter at `path`, read and checked (LoraError naming the file and the problem), not served yet: it
        touches nothing of the slots', so a worker reads on a thread of its own while the engine steps (its disk
        read is the slow part of a load), then `put`s it."""
        self._check_serving(name)
        return self.device.read(name, path)

    def _check_unused(self, name: str) -> None:
        if self.queued[name]:
            raise LoraError(f"adapter {name!r} is in use by {self.queued[name]} request(s): add it under another "
                            "name, or once they finish")

    def _check_serving(self, name: str) -> None:
        if self.device is None or not self.slots:
            raise LoraError(f"cannot add adapter {name!r}: this engine serves no LoRA adapters; start it with "
                            "max_loras >= 1 (and a model, not a simulated runner)")

    def put(self, name: str, adapter: Any) -> None:
        """Serve an adapter `read` gave as `name` (so this engine serves adapters), making room in host memory if
        need be (LoraError when none, or when requests name `name` now: one may have come while it was read)."""
        self._check_unused(name)
        self._drop(name)
        if self.max_cpu_loras is not None and len(self.adapters) >= self.max_cpu_loras:
            spare = next((n for n in self.adapters if not self.queued[n]), None)
            if spare is None:
                raise LoraError(f"cannot add adapter {name!r}: host memory holds max_cpu_loras={self.max_cpu_loras} "
                                "adapters and requests name each of them; raise max_cpu_loras or wait")
            self._drop(spare)
        self.adapters[name] = adapter
        self.seeds[name] = hash(("lora", name, next(_generations)))

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise LoraError(f"adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        if self.queued[name]:
            raise LoraError(f"adapter {name!r} is in use by {self.queued[name]} request(s): remove it once they finish")
        self._drop(name)

    def _drop(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.seeds.pop(name, None)
        if name in self.slots:
            slot = self.slots.index(name)
            self.slots[slot] = None
            self.idle.pop(slot, None)

    def seed(self, name: str | None) -> int | None:
        """The prefix-cache seed of a request's adapter (None: the base model); an unknown adapter is rejected."""
        if name is None:
            return None
        if name not in self.adapters:
            raise RequestRejected(f"unknown LoRA adapter {name!r}: add it first (loaded: {sorted(self.adapters)})")
        return self.seeds[name]

    # ---- the slots (called by the scheduler) ----------------------------------------------------------------

    def enqueue(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.queued[seq.lora] += 1

    def dequeue(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.queued[seq.lora] -= 1
            if not self.queued[seq.lora]:
                del self.queued[seq.lora]

    def can_acquire(self, seq: Sequence) -> bool:
        """May this sequence start now as far as adapters go (the module docstring's rule)?"""
        return seq.lora is None or self.has_room(seq.lora)

    def has_room(self, name: str) -> bool:
        """Could a sequence of adapter `name` start now: in a slot already, a slot free, or one no running sequence
        uses (the worker asks before it reads such a job: engine.loras.has_room)."""
        return name in self.slots or None in self.slots or bool(self.idle)

    def spare(self) -> int:
        """Slots a new adapter could take now: free ones and those no running sequence uses."""
        return self.slots.count(None) + len(self.idle)

    def acquire(self, seq: Sequence) -> None:
        """Pin the sequence's adapter in a slot, loading it there first if need be; `can_acquire` said yes."""
        if seq.lora is None:
            return
        name = seq.lora
        if name in self.slots:
            slot = self.slots.index(name)
        else:
            slot = self.slots.index(None) if None in self.slots else self._evict()
            self.device.load(slot, self.adapters[name])
            self.slots[slot] = name
            self.loads += 1
        self.idle.pop(slot, None)
        self.running[name] += 1
        seq.lora_slot = slot

    def release(self, seq: Sequence) -> None:
        """The sequence stops running (finished or preempted): unpin its adapter once no running sequence uses it."""
        if seq.lora_slot < 0:
            return
        self.running[seq.lora] -= 1
        if not self.running[seq.lora]:
            del self.running[seq.lora]
            self.idle[seq.lora_slot] = None
        seq.lora_slot = -1

    def _evict(self) -> int:
        slot, _ = self.idle.popitem(last=False)
        self.slots[slot] = None
        self.evictions += 1
        return slot
