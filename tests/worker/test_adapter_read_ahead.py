"""Adapters read ahead (worker/adapter_reads.py `warm`): each heartbeat, adapters not in host memory whose jobs wait in
Redis are read from disk before a job of theirs arrives, so that job waits for a copy into a slot, not a read (in
W-LORA's fleet a tenth of the running sequences stood idle mid-run behind reads of adapters new to their worker). Never
while a job here waits for a read, never past host memory's room, and a read ahead that failed is not tried ahead
again while a job of that adapter still gets the error from its start."""
from __future__ import annotations

import threading

import pytest

from kvgate.engine.lora import LoraError
from kvgate.engine.lora_slots import LoraSlots
from kvgate.engine.simulated_loras import SimulatedLoras
from kvgate.producer import Client
from kvgate.worker.adapter_reads import WARM_READS, AdapterReads
from kvgate.worker.adapters import Adapters
from kvgate.worker.clock import ServerClock
from kvgate.worker.null_metrics import NullMetrics
from kvgate.worker.settings import WorkerSettings
from tests.support import simulated_adapter, wait_for
from tests.worker.test_lora_placement import BASE, _engine


class GatedLoras(SimulatedLoras):
    """Reads wait for `gate` (a test holds them in flight), and count."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.reads = threading.Event(), []

    def read(self, name: str, path: str) -> str:
        self.reads.append(name)
        self.gate.wait(10)
        return super().read(name, path)


def _reads(max_cpu_loras: int | None = None) -> tuple[AdapterReads, LoraSlots, GatedLoras]:
    device = GatedLoras()
    slots = LoraSlots(2, max_cpu_loras, device)
    return AdapterReads(slots), slots, device


def test_adapters_whose_jobs_wait_are_read_ahead_most_wanted_first_and_land_in_host_memory(tmp_path):
    reads, slots, device = _reads()
    wanted = [(n, simulated_adapter(tmp_path, n)) for n in ("most", "next", "third")]
    assert reads.warm(wanted) == ["most", "next"][:WARM_READS]
    assert reads.warm(wanted) == []  # the readers ahead are busy
    device.gate.set()
    wait_for(lambda: all(f.done() for f in reads.reading.values()), timeout=5, what="the reads ahead")
    assert reads.warm(wanted) == ["third"]  # the two finished ones put in host memory, the third started
    assert "most" in slots and "next" in slots
    assert reads.ready("most", wanted[0][1], idle=False)  # a job of it: a slot load away, no read


def test_no_read_ahead_while_a_job_waits_for_a_read_or_past_host_memorys_room(tmp_path):
    reads, slots, device = _reads()
    folder = simulated_adapter(tmp_path, "a-job's")
    assert not reads.ready("a-job's", folder, idle=False)  # a job's read in flight
    assert reads.warm([("ahead", simulated_adapter(tmp_path, "ahead"))]) == []
    device.gate.set()
    wait_for(lambda: reads.ready("a-job's", folder, idle=False), timeout=5, what="the job's read")
    full, full_slots, full_device = _reads(max_cpu_loras=2)
    full_device.gate.set()
    full_slots.add("kept-1", simulated_adapter(tmp_path, "kept-1"))
    assert full.warm([("x", simulated_adapter(tmp_path, "x")), ("y", simulated_adapter(tmp_path, "y"))]) == ["x"]
    wait_for(lambda: full.reading["x"].done(), timeout=5, what="the read ahead")
    assert full.warm([("y", simulated_adapter(tmp_path, "y"))]) == []  # x in: host memory full, kept-1 not evicted
    assert "kept-1" in full_slots and "x" in full_slots


def test_a_read_ahead_that_fails_is_not_tried_ahead_again_and_its_job_still_gets_the_error(tmp_path):
    reads, slots, device = _reads()
    device.gate.set()
    broken = str(tmp_path / "broken")  # no adapter_config.json: the read fails naming the file
    assert reads.warm([("broken", broken)]) == ["broken"]
    wait_for(lambda: reads.reading["broken"].done(), timeout=5, what="the read ahead")
    assert reads.warm([("broken", broken)]) == []  # the failure put nothing in, and is not read ahead again
    assert "broken" not in slots and device.reads == ["broken"]
    wait_for(lambda: reads.ready("broken", broken, idle=False), timeout=5, what="a job's read of it")
    assert device.reads == ["broken", "broken"] and "broken" not in slots  # the job's read: its own, failed too
    with pytest.raises(LoraError, match="adapter_config.json"):
        slots.add("broken", broken)  # the job's start reads it once more and answers the job with this error


def test_the_adapters_to_read_ahead_are_those_not_in_host_memory_whose_jobs_wait_most_first(queue, tmp_path):
    engine = _engine(2)
    with Client(queue.server.url, queue.ns) as client:
        for name, jobs in (("few", 1), ("many", 3), ("known", 5)):
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
            for i in range(jobs):
                client.submit(f"{name} {i}", lora=name, max_tokens=2)
    settings = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, max_loras=2)
    adapters = Adapters(queue.r, queue.keys, engine, BASE, settings, ServerClock(queue.r), NullMetrics())
    adapters.start([])
    engine.loras.add("known", adapters.paths["known"])  # in host memory already
    adapters.check_aging(fair=False)
    assert [name for name, _ in adapters.to_read_ahead()] == ["many", "few"]
    assert dict(adapters.to_read_ahead())["many"] == adapters.paths["many"]
