"""LoRA adapters beside tenants, affinity lanes and priorities (issue 42 with fair share, quotas and lanes): an
adapter's jobs count in their tenant's share and quotas as base jobs do, naming an adapter is no way around either,
nothing an adapter's producer sends is stranded with fair share or lanes on (also for an adapter registered while
the workers run), and priorities stay strict for adapter jobs."""
from __future__ import annotations

import pytest

from kvgate import Client
from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer import Quota, QuotaExceeded
from tests.support import simulated_adapter, wait_for

BASE = "org/base"
JOB = {"prompt": "the same prompt", "max_tokens": 8, "ignore_eos": True}



def _engine(max_loras: int = 2) -> SimulatedEngine:
    return SimulatedEngine(num_blocks=512, block_size=16, max_num_seqs=8, step_overhead_s=0.002, per_token_s=0.00005,
                           max_loras=max_loras)


def _worker(thread_worker, engine, worker_id="w1", **settings):
    """As test_fair's workers: 4 jobs at a time (the worker's max_num_seqs)."""
    settings = {"served_model_name": BASE, "max_loras": len(engine.loras.slots), "heartbeat_interval_s": 0.1,
                "max_num_seqs": 4, **settings}
    return thread_worker(engine=engine, worker_id=worker_id, **settings)


def _done(queue, handles) -> int:
    pipe = queue.r.pipeline(transaction=False)
    for h in handles:
        pipe.exists(queue.keys.result(h.job_id))
    return sum(pipe.execute())


def _share_of_heavy(queue, thread_worker, tmp_path, heavy_model: str, light_model: str) -> tuple[int, int]:
    """Tenants `heavy` (weight 3) and `light` (1), 300 jobs each, backlogged before one worker starts: how many of
    each are served by the time 160 are."""
    queue.r.set(queue.keys.fair(), 1)
    queue.r.hset(queue.keys.tenants(), mapping={"heavy": 3})
    url, ns = queue.server.url, queue.ns
    with Client(url, ns, tenant="heavy") as heavy, Client(url, ns, tenant="light") as light:
        for name in {heavy_model, light_model} - {BASE}:
            heavy.add_lora(name, simulated_adapter(tmp_path, name), BASE)
        h = heavy.submit_many([{**JOB, "model": heavy_model}] * 300)
        lt = light.submit_many([{**JOB, "model": light_model}] * 300)
        with _worker(thread_worker, _engine()):
            wait_for(lambda: _done(queue, h) + _done(queue, lt) >= 160, 90, "160 jobs served")
            return _done(queue, h), _done(queue, lt)


@pytest.mark.parametrize("heavy_model,light_model", [("x", "x"), ("x", "y"), (BASE, "y"), ("x", BASE)],
                         ids=["one-adapter", "two-adapters", "light-on-an-adapter", "heavy-on-an-adapter"])
def test_weights_three_to_one_hold_for_adapter_jobs_whichever_model_each_tenant_names(
        queue, thread_worker, tmp_path, heavy_model, light_model):
    """A tenant's share counts its jobs of the base model and of every adapter of it together: naming an adapter (its
    own streams) is no way around the shares."""
    h, lt = _share_of_heavy(queue, thread_worker, tmp_path, heavy_model, light_model)
    assert h < 300 and lt < 300  # both still backlogged
    assert abs(h / (h + lt) - 3 / 4) <= 0.15 * 3 / 4, (h, lt)


def test_a_tenant_with_jobs_of_several_adapters_gets_one_share_not_one_per_adapter(queue, thread_worker, tmp_path):
    queue.r.set(queue.keys.fair(), 1)
    url, ns = queue.server.url, queue.ns
    with Client(url, ns, tenant="many") as many, Client(url, ns, tenant="one") as one:
        for name in ("x", "y", "z"):
            many.add_lora(name, simulated_adapter(tmp_path, name), BASE)
        spread = many.submit_many([{**JOB, "model": m} for m in ("x", "y", BASE) for _ in range(150)])
        single = one.submit_many([{**JOB, "model": "z"}] * 300)
        with _worker(thread_worker, _engine(max_loras=3)):
            wait_for(lambda: _done(queue, spread) + _done(queue, single) >= 160, 90, "160 jobs served")
            s, o = _done(queue, spread), _done(queue, single)
    assert abs(s / (s + o) - 1 / 2) <= 0.15 / 2, (s, o)


def test_an_adapter_registered_while_a_fair_worker_runs_has_its_tenants_jobs_read(queue, thread_worker, tmp_path):
    queue.r.set(queue.keys.fair(), 1)
    with Client(queue.server.url, queue.ns, tenant="a") as client:
        with _worker(thread_worker, _engine()) as w:
            assert client.submit("hi", model=BASE, max_tokens=2).result(timeout=60).status == "done"
            client.add_lora("late", simulated_adapter(tmp_path, "late"), BASE)
            wait_for(lambda: "late" in w.worker.adapters.paths, 30, "the worker to see the adapter")
            result = client.submit("hi", lora="late", max_tokens=2).result(timeout=60)
    assert (result.status, result.model) == ("done", "late")


def test_an_adapter_registered_while_a_worker_with_lanes_runs_has_its_lane_jobs_read(queue, thread_worker, tmp_path):
    with Client(queue.server.url, queue.ns) as client:
        with _worker(thread_worker, _engine(), affinity="on", affinity_lanes=4) as w:
            wait_for(lambda: queue.r.get(queue.keys.lanes()), 30, "the lane count")
            assert client.submit("hi", model=BASE, max_tokens=2).result(timeout=60).status == "done"
            client.add_lora("late", simulated_adapter(tmp_path, "late"), BASE)
            wait_for(lambda: "late" in w.worker.adapters.paths, 30, "the worker to see the adapter")
            handle = client.submit("a prompt of its own lane", lora="late", max_tokens=2)
            stream = client.router.entry(handle.job_id)[0]
            result = handle.result(timeout=60)
    assert stream.startswith(f"{queue.ns}:jobs:late:normal:")  # in one of the adapter's lanes
    assert (result.status, result.model) == ("done", "late")


def test_adapter_jobs_sharing_a_prefix_go_to_one_lane_and_hit_the_prefix_cache(queue, thread_worker, tmp_path):
    prefix = "a long shared system prompt " * 40
    with Client(queue.server.url, queue.ns) as client:
        client.add_lora("x", simulated_adapter(tmp_path, "x"), BASE)
        with _worker(thread_worker, _engine(), affinity="on", affinity_lanes=4) as w:
            wait_for(lambda: queue.r.get(queue.keys.lanes()), 30, "the lane count")
            wait_for(lambda: w.worker.affinity.owned_count, 30, "the worker to own lanes")
            streams, results = set(), []
            for which in ("first", "second"):  # one after the other: the second finds the first's prefix cached
                handle = client.submit(prefix + which, lora="x", max_tokens=2)
                streams.add(client.router.entry(handle.job_id)[0])
                results.append(handle.result(timeout=60))
            second = results[1]
    assert len(streams) == 1 and streams.pop().startswith(f"{queue.ns}:jobs:x:normal:"), streams  # one lane of x
    assert second.status == "done" and second.usage.cached_tokens > 0


def test_a_tenant_over_its_jobs_quota_is_refused_for_adapter_jobs_as_for_base_ones(queue, tmp_path):
    with Client(queue.server.url, queue.ns, tenant="t", quota=Quota(max_jobs=2)) as client:
        client.add_lora("x", simulated_adapter(tmp_path, "x"), BASE)
        client.submit("hi", model=BASE)
        client.submit("hi", lora="x")
        for submit in (lambda: client.submit("hi", lora="x"), lambda: client.submit("hi", model="x"),
                       lambda: client.submit("hi", model=BASE)):
            with pytest.raises(QuotaExceeded) as refused:
                submit()
            assert (refused.value.tenant, refused.value.ceiling) == ("t", "max_jobs")


def test_a_tenant_over_its_tokens_quota_is_refused_for_adapter_jobs(queue, tmp_path):
    with Client(queue.server.url, queue.ns, tenant="t", quota=Quota(tokens_per_minute=100)) as client:
        client.add_lora("x", simulated_adapter(tmp_path, "x"), BASE)
        client.submit("hi", lora="x", max_tokens=90)
        with pytest.raises(QuotaExceeded) as refused:
            client.submit("hi", model="x", max_tokens=20)
        assert refused.value.ceiling == "tokens_per_minute"


@pytest.mark.parametrize("fair", [False, True], ids=["shared-streams", "fair-share"])
def test_adapter_jobs_are_served_in_strict_priority_order(queue, thread_worker, tmp_path, fair):
    if fair:
        queue.r.set(queue.keys.fair(), 1)
    with Client(queue.server.url, queue.ns, tenant="a") as client:
        client.add_lora("x", simulated_adapter(tmp_path, "x"), BASE)
        low = client.submit_many([{**JOB, "model": "x", "priority": "low"}] * 60)
        high = client.submit_many([{**JOB, "model": "x", "priority": "high"}] * 20)
        with _worker(thread_worker, _engine(), max_num_seqs=2):
            results = [h.result(timeout=60) for h in low + high]
    assert all(r.status == "done" for r in results)
    order = [r.job_id for r in sorted(results, key=lambda r: r.timings.admitted)]
    first_low = min(order.index(h.job_id) for h in low)
    assert first_low >= 16, order[:20]  # low jobs start only as the last high ones run (2 slots, few queued)



def test_under_fair_share_an_adapters_job_waiting_past_the_aging_bound_is_read_by_a_worker_without_room_for_it(
        queue, thread_worker, tmp_path):
    """Aging (--lora-aging-ms) looks at the adapter's tenants' streams too: with fair share on its jobs wait there."""
    queue.r.set(queue.keys.fair(), 1)
    busy = _engine(max_loras=1)
    with Client(queue.server.url, queue.ns, tenant="a") as client:
        for name in ("hot", "cold"):
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
        with _worker(thread_worker, busy, lora_aging_ms=200):
            long = client.submit("hold the slot", lora="hot", max_tokens=50_000, ignore_eos=True)
            wait_for(lambda: busy.loras.running.get("hot"), 60, "a running job of hot")
            cold = client.submit("hi", lora="cold", max_tokens=3)
            # read while hot still holds the only slot (not once its job ended and freed it)
            seen = wait_for(lambda: (s := cold.status().state) != "queued" and (s, client.get(long.job_id) is None),
                            60, "the aged job to be read")
            long.cancel()  # the slot frees: the aged job, waiting in the engine here, takes it
            result = cold.result(timeout=60)
    assert seen == ("running", True) and result.status == "done" and result.worker == "w1"
