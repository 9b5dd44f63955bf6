"""A worker serves its model's registered LoRA adapters (worker/adapters.py), each from its own streams: it loads an
adapter on its first job, answers a bad one's jobs with an error result and keeps serving, leaves an adapter's jobs
for a worker that holds it while its slots are busy (until they age), and answers jobs of a removed adapter."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer import Client
from kvgate.producer.keys import Keys
from tests.support import simulated_adapter, wait_for

BASE = "org/base"



def _engine(max_loras: int = 2, load_s: float = 0.0) -> SimulatedEngine:
    return SimulatedEngine(num_blocks=512, max_num_seqs=8, step_overhead_s=0.002, per_token_s=0.00005,
                           max_loras=max_loras, lora_load_s=load_s)


def _worker(thread_worker, engine, worker_id, **settings):
    settings = {"served_model_name": BASE, "max_loras": len(engine.loras.slots), "heartbeat_interval_s": 0.1,
                **settings}
    return thread_worker(engine=engine, worker_id=worker_id, **settings)


def test_a_job_for_a_registered_adapter_is_answered_by_a_worker_that_loads_it_on_first_use(
        thread_worker, queue, tmp_path):
    url, ns = queue.server.url, queue.ns
    engine = _engine()
    with Client(url, ns) as client:
        client.add_lora("c1", simulated_adapter(tmp_path, "c1"), BASE)
        with _worker(thread_worker, engine, "w1", loras=[f"c0={simulated_adapter(tmp_path, 'c0')}"]) as w:
            assert "c0" in engine.loras and "c1" not in engine.loras  # --lora: loaded at start
            assert set(client.loras()) == {"c0", "c1"} and client.loras()["c0"].base == BASE
            done = [client.submit("hi", lora=name, max_tokens=3).result(timeout=60) for name in ("c1", "c0")]
            assert [(r.status, r.model) for r in done] == [("done", "c1"), ("done", "c0")]
            assert client.submit("hi", model=BASE, max_tokens=3).result(timeout=60).model == BASE
            client.add_lora("c2", simulated_adapter(tmp_path, "c2"), BASE)  # registered while the worker runs: its next beat
            assert client.submit("hi", lora="c2", max_tokens=3).result(timeout=60).model == "c2"
            assert "c1" in engine.loras and engine.loras.loads >= 2

            def beat():  # the heartbeat says which adapters the slots hold, and the loads so far
                raw = queue.r.hget(Keys(ns).worker("w1"), "loras")
                seen = json.loads(raw) if raw else None
                return seen if seen and seen["loads"] == engine.loras.loads else None

            seen = wait_for(beat, 30, "a heartbeat with the adapters loaded")
            assert seen["loaded"] == sorted(engine.loras.loaded) and seen["evictions"] == engine.loras.evictions
            metrics = w.worker.metrics  # and the Prometheus figures, from the same look
            assert metrics.lora_loads._value.get() == seen["loads"] and metrics.loras_loaded._value.get() >= 1


def test_a_bad_adapter_is_its_jobs_error_result_and_the_worker_keeps_serving(thread_worker, queue, tmp_path):
    url, ns = queue.server.url, queue.ns
    with Client(url, ns) as client:
        client.add_lora("broken", str(tmp_path / "no-such-folder"), BASE)
        with _worker(thread_worker, _engine(), "w1"):
            bad = client.submit("hi", lora="broken", max_tokens=3).result(timeout=60)
            assert bad.status == "error" and "adapter_config.json is missing" in bad.error
            assert client.submit("hi", model=BASE, max_tokens=3).result(timeout=60).status == "done"


def test_a_worker_without_adapter_slots_refuses_a_lora_flag(thread_worker, tmp_path):
    with pytest.raises(ValueError, match="--max-loras >= 1"):
        thread_worker(engine=_engine(0), worker_id="w0", served_model_name=BASE,
                      loras=[f"c0={simulated_adapter(tmp_path, 'c0')}"])


def test_jobs_of_an_adapter_removed_while_they_wait_get_error_results(thread_worker, queue, tmp_path):
    url, ns = queue.server.url, queue.ns
    with Client(url, ns) as client:
        client.add_lora("gone", simulated_adapter(tmp_path, "gone"), BASE)
        with _worker(thread_worker, _engine(), "w1") as w:
            assert client.submit("hi", lora="gone", max_tokens=2).result(timeout=60).status == "done"
            # the worker looks away from the adapter's streams for now
            w.worker.refill.models_now = SimpleNamespace(now=lambda: [BASE], look_again=lambda: False)
            handles = [client.submit("hi", lora="gone", max_tokens=2) for _ in range(3)]
            assert client.remove_lora("gone")
            wait_for(lambda: "gone" not in w.worker.adapters.paths, 30, "the worker to see the removal")
            w.worker.refill.models_now = w.worker.adapters.reads(w.worker.served.names)
            results = [h.result(timeout=60) for h in handles]
    assert all(r.status == "error" and "removed from the fleet's registry" in r.error for r in results)
    assert redis_keys_left(queue) == 0


def test_jobs_of_an_adapter_removed_before_any_worker_of_its_base_started_get_error_results(
        thread_worker, queue, tmp_path):
    url, ns = queue.server.url, queue.ns
    with Client(url, ns) as client:
        client.add_lora("gone", simulated_adapter(tmp_path, "gone"), BASE)
        handles = [client.submit("hi", lora="gone", max_tokens=2) for _ in range(3)]
        assert client.remove_lora("gone") and "gone" not in client.loras()
        with _worker(thread_worker, _engine(), "w1"):  # it never knew the adapter: the tombstone tells it
            results = [h.result(timeout=60) for h in handles]
    assert all(r.status == "error" and "removed from the fleet's registry" in r.error for r in results)
    assert redis_keys_left(queue) == 0


def test_a_read_looks_at_no_more_unloaded_adapters_than_slots_could_take_taking_turns(queue, tmp_path):
    from kvgate.worker.adapters import Adapters
    from kvgate.worker.clock import ServerClock
    from kvgate.worker.null_metrics import NullMetrics
    from kvgate.worker.settings import WorkerSettings

    engine = _engine(max_loras=2)
    names = ["a", "b", "c", "d"]
    with Client(queue.server.url, queue.ns) as client:
        for name in names:
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
    settings = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, max_loras=2)
    adapters = Adapters(queue.r, Keys(queue.ns), engine, BASE, settings, ServerClock(queue.r), NullMetrics())
    assert adapters.start([]) == names
    reads = [adapters.readable((BASE,)) for _ in range(4)]
    assert all(r[0] == BASE and len(r) == 3 for r in reads)  # two slots spare: two adapters per read
    assert {a for r in reads for a in r[1:]} == set(names)  # in turns: every adapter is looked at
    engine.loras.add("a", adapters.paths["a"])
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), lora="a")
    engine.step()  # a runs: its slot is pinned, one is spare
    assert all("a" in r and len(r) == 3 for r in (adapters.readable((BASE,)) for _ in range(3)))


def redis_keys_left(queue) -> int:
    """Jobs of the adapter's streams not acknowledged: none may be left behind."""
    r, keys = queue.server.client(), Keys(queue.ns)
    return sum(g["pending"] + (g.get("lag") or 0) for p in ("high", "normal", "low")
               for g in r.xinfo_groups(keys.jobs("gone", p)) if r.exists(keys.jobs("gone", p)))


def _pin_the_slot(client, w1_engine, adapter: str):
    """A long job of `adapter` running on the worker: its one slot is pinned until the job is cancelled."""
    long = client.submit("hold the slot", lora=adapter, max_tokens=3000)
    wait_for(lambda: w1_engine.loras.running.get(adapter), 60, f"a running job of {adapter}")
    return long


def test_a_worker_whose_slots_are_busy_leaves_an_adapters_job_for_a_worker_with_room(thread_worker, queue, tmp_path):
    url, ns = queue.server.url, queue.ns
    busy = _engine(max_loras=1)
    with Client(url, ns) as client:
        for name in ("hot", "cold"):
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
        with _worker(thread_worker, busy, "w1", lora_aging_ms=600_000):
            long = _pin_the_slot(client, busy, "hot")
            cold = client.submit("hi", lora="cold", max_tokens=3)
            with _worker(thread_worker, _engine(max_loras=1), "w2"):
                result = cold.result(timeout=60)
            long.cancel()
    assert result.status == "done" and result.worker == "w2" and "cold" not in busy.loras


def test_an_adapters_job_waiting_past_the_aging_bound_is_read_by_a_worker_without_room_for_it(
        thread_worker, queue, tmp_path):
    url, ns = queue.server.url, queue.ns
    busy = _engine(max_loras=1)
    with Client(url, ns) as client:
        for name in ("hot", "cold"):
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
        with _worker(thread_worker, busy, "w1", lora_aging_ms=200):
            long = _pin_the_slot(client, busy, "hot")
            cold = client.submit("hi", lora="cold", max_tokens=3)
            wait_for(lambda: cold.status().state != "queued", 60, "the aged job to be read")
            long.cancel()  # the slot frees: the aged job, waiting in the engine here, takes it
            result = cold.result(timeout=60)
    assert result.status == "done" and result.worker == "w1"


def test_a_running_batch_steps_on_while_a_new_adapter_is_read_from_disk(thread_worker, queue, tmp_path):
    """An adapter is read from its folder on its first job here; on the worker's loop that read stopped every running
    sequence's steps until it ended (W-LORA's fleet: a 250 ms load stalled 16 sequences). Read on a thread, it holds
    only its own job: here the read is held until a base-model job submitted with it has finished, which on the loop
    could never happen."""
    import threading

    engine = _engine()
    release, read_began = threading.Event(), threading.Event()
    real_read = engine.loras.device.read

    def held_read(name, path):
        read_began.set()
        release.wait(60)  # on the loop: the base job below never finishes while this waits
        return real_read(name, path)

    engine.loras.device.read = held_read
    with Client(queue.server.url, queue.ns) as client:
        client.add_lora("slow", simulated_adapter(tmp_path, "slow"), BASE)
        with _worker(thread_worker, engine, "w1"):
            adapter_job = client.submit("hi", lora="slow", max_tokens=3)
            assert read_began.wait(30)
            base = client.submit("hi", model=BASE, max_tokens=20, ignore_eos=True).result(timeout=20)
            assert base.status == "done" and not adapter_job.done()  # stepped while the adapter's read was held
            release.set()
            assert adapter_job.result(timeout=30).status == "done"
            assert "slow" in engine.loras


def test_a_job_whose_adapter_has_no_slot_waits_in_the_local_queue_and_the_jobs_behind_it_pass(
        thread_worker, queue, tmp_path, monkeypatch):
    """An aged adapter's job is read by a worker with no slot for it; in the engine it waited first in line and held
    every admission behind it until a slot was idle (W-LORA's fleet: a few such jobs a moment, each stopping its
    worker's admissions). It now waits in the local queue (up to SLOT_HOLD_S) while the jobs behind it pass."""
    from kvgate.worker import flights

    monkeypatch.setattr(flights, "SLOT_HOLD_S", 30.0)  # longer than a loaded machine could take to read the base job
    engine = _engine(max_loras=1)
    with Client(queue.server.url, queue.ns) as client:
        for name in ("long", "cold"):
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
        with _worker(thread_worker, engine, "w1", lora_aging_ms=50) as w:
            long = client.submit("hi", lora="long", max_tokens=3000, ignore_eos=True)  # pins the one slot
            wait_for(lambda: "long" in engine.loras.running, 30, "the long job to run")
            cold = client.submit("hi", lora="cold", max_tokens=2)  # aged soon: read without a slot
            held = lambda: any(t.lora == "cold" for t in w.worker.queue.tickets) or any(  # noqa: E731
                s.lora == "cold" for s in engine.scheduler.waiting)
            wait_for(held, 30, "the cold adapter's job to be read")
            base = client.submit("hi", model=BASE, max_tokens=3).result(timeout=60)
            assert base.status == "done" and not long.done()  # passed while the long job still held the slot
            assert long.result(timeout=120).status == "done" and cold.result(timeout=60).status == "done"  # its slot
