"""The slot table alone (engine/lora_slots.py), with a stand-in device: which slot a sequence's adapter gets, what
is evicted, what host memory keeps, and what is refused."""
from __future__ import annotations

import pytest

from kvgate.engine import LoraError, RequestRejected, SamplingParams
from kvgate.engine.lora_slots import LoraSlots
from kvgate.engine.sequence import Sequence


class Device:
    def __init__(self) -> None:
        self.slots: dict[int, str] = {}

    def read(self, name, path):
        if path == "bad":
            raise LoraError(f"{path}/adapter_config.json is missing")
        return name

    def load(self, slot, adapter):
        self.slots[slot] = adapter


def seq(lora):
    s = Sequence("r", [1, 2], SamplingParams(), 4, lora=lora)
    return s


def slots_with(max_loras, names, max_cpu_loras=None):
    device = Device()
    slots = LoraSlots(max_loras, max_cpu_loras, device)
    for name in names:
        slots.add(name, f"/adapters/{name}")
    return slots, device


def start(slots, s):
    slots.enqueue(s)
    assert slots.can_acquire(s)
    slots.acquire(s)
    return s


def test_the_least_recently_used_idle_slot_is_evicted_and_a_pinned_one_never_is():
    slots, device = slots_with(2, ["a", "b", "c"])
    a, b = start(slots, seq("a")), start(slots, seq("b"))
    assert (a.lora_slot, b.lora_slot) == (0, 1) and device.slots == {0: "a", 1: "b"}
    c = seq("c")
    slots.enqueue(c)
    assert not slots.can_acquire(c)  # both pinned by running sequences: c waits
    slots.release(b)
    slots.release(a)  # a is now the most recently used idle slot
    slots.acquire(c)
    assert c.lora_slot == 1 and device.slots == {0: "a", 1: "c"} and slots.evictions == 1
    again = start(slots, seq("a"))  # still loaded: no load
    assert again.lora_slot == 0 and slots.loads == 3


def test_the_base_model_needs_no_slot_and_an_unknown_adapter_is_rejected():
    slots, _ = slots_with(1, ["a"])
    start(slots, seq("a"))
    base = seq(None)
    assert slots.can_acquire(base) and slots.seed(None) is None
    with pytest.raises(RequestRejected, match="unknown LoRA adapter 'zz'"):
        slots.seed("zz")


def test_host_memory_drops_the_oldest_adapter_no_request_names_or_refuses():
    slots, _ = slots_with(1, ["a", "b"], max_cpu_loras=2)
    slots.enqueue(seq("a"))
    slots.add("c", "/adapters/c")  # a is named by a queued request: b goes
    assert list(slots.adapters) == ["a", "c"]
    slots.enqueue(seq("c"))
    with pytest.raises(LoraError, match="max_cpu_loras=2 adapters and requests name each of them"):
        slots.add("d", "/adapters/d")


def test_an_adapter_in_use_is_neither_removed_nor_replaced_and_a_bad_one_changes_nothing():
    slots, _ = slots_with(1, ["a"])
    first_seed = slots.seed("a")
    s = start(slots, seq("a"))
    with pytest.raises(LoraError, match="in use by 1 request"):
        slots.remove("a")
    with pytest.raises(LoraError, match="in use by 1 request"):
        slots.add("a", "/adapters/a2")
    with pytest.raises(LoraError, match="adapter_config.json is missing"):
        slots.add("x", "bad")
    slots.release(s)
    slots.dequeue(s)
    slots.add("a", "/adapters/a2")  # replaced: a new prefix-cache seed, and its old slot no longer counts as loaded
    assert slots.seed("a") != first_seed and slots.loaded == {}
