"""Where adapters' jobs run (worker/adapters.py): a read looks first at the adapters not loaded here whose jobs waited
longest, whatever their place in the registry (by turns alone, the most popular adapter's backlog waited for its turn
while workers ran half empty: W-LORA's fleet half), and a job naming an adapter on its base model's shared stream (the
adapter-blind layout W-LORA compares against) is served with that adapter, loaded on demand."""
from __future__ import annotations

import random
import time

import pytest

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer import Client
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import encode
from kvgate.worker.adapters import Adapters
from kvgate.worker.clock import ServerClock
from kvgate.worker.null_metrics import NullMetrics
from kvgate.worker.settings import WorkerSettings
from tests.support import simulated_adapter

BASE = "org/base"



def _engine(max_loras: int) -> SimulatedEngine:
    return SimulatedEngine(num_blocks=512, max_num_seqs=8, step_overhead_s=0.002, per_token_s=0.00005,
                           max_loras=max_loras)


def test_a_read_looks_first_at_the_adapters_whose_jobs_wait_whatever_the_registry_order(queue, tmp_path):
    names = ["a", "b", "c", "d"]
    with Client(queue.server.url, queue.ns) as client:
        for name in names:
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
        settings = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, max_loras=1)
        adapters = Adapters(queue.r, queue.keys, _engine(1), BASE, settings, ServerClock(queue.r), NullMetrics())
        assert adapters.start([]) == names
        client.submit("first", lora="d", max_tokens=2)  # the last adapters in the registry's order have jobs
        client.submit("second", lora="c", max_tokens=2)
        adapters.check_aging(fair=False)  # the heartbeat's look at the streams of the adapters not loaded here
    assert adapters.backlog == {"c": 1, "d": 1}
    first = adapters.readable((BASE,))  # one slot spare: one adapter a read, one of those whose jobs wait
    second = adapters.readable((BASE,))
    assert {first[1], second[1]} == {"c", "d"} and len(first) == len(second) == 2  # each looked at once per look
    assert adapters.waiting == {} and adapters.aged == set()  # one slot, free: room for each, none aged
    later = [adapters.readable((BASE,))[1] for _ in range(4)]
    assert set(later) == {"a", "b", "c", "d"}  # then in turns, none always left out


def test_a_job_naming_an_adapter_on_its_base_models_stream_is_served_with_it_loaded_on_demand(
        thread_worker, queue, tmp_path):
    engine = _engine(1)  # one slot: the second adapter's job evicts the first's
    with Client(queue.server.url, queue.ns) as client:
        for name in ("x", "y"):
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
    with thread_worker(engine=engine, worker_id="w1", served_model_name=BASE, max_loras=1, heartbeat_interval_s=0.1):
        for name in ("x", "y"):  # one after the other: each finds the slot idle
            job = queue.job(prompt_token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True, model=name)
            queue.xadd(encode(job), model=BASE)  # the base's shared stream, not the adapter's own
            queue.wait_finals(1 + (name == "y"))
    finals = queue.finals()
    assert [(f.status, f.model) for f in finals] == [("done", "x"), ("done", "y")]
    assert engine.loras.loads == 2 and engine.loras.evictions == 1 and engine.loras.loaded == {"y": 0}


def test_an_adapter_ages_only_once_its_jobs_waited_longer_than_those_of_the_adapters_held_here(queue, tmp_path):
    from kvgate.engine.sampling_params import SamplingParams

    engine = _engine(1)
    with Client(queue.server.url, queue.ns) as client:
        for name in ("hot", "cold"):
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
        settings = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, max_loras=1, lora_aging_ms=300)
        adapters = Adapters(queue.r, queue.keys, engine, BASE, settings, ServerClock(queue.r), NullMetrics())
        adapters.start([])
        engine.loras.add("hot", adapters.paths["hot"])
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), lora="hot")
        engine.step()  # hot runs in the one slot: no room here for cold
        client.submit("a backlog", lora="hot", max_tokens=2)
        client.submit("behind it", lora="cold", max_tokens=2)
        time.sleep(0.4)  # both waited past the bound (the server's clock: entry ids)
        adapters.check_aging(fair=False)
        assert adapters.aged == set() and set(adapters.waiting) == {"cold"}  # a backlog: cold waited no longer
        queue.r.xreadgroup(Keys.GROUP, "another", {queue.keys.jobs("hot", "normal"): ">"}, count=10)
        adapters.check_aging(fair=False)  # nothing of hot waits now: cold's wait counts from its job's arrival
    assert adapters.aged == {"cold"} and "cold" in adapters.readable((BASE,))


def test_the_heartbeats_look_at_200_adapters_streams_is_one_script_without_fair_share(queue, tmp_path):
    """Without fair share no job waits in a tenant's stream: the look sends no ZRANGE a band (600 for 200 adapters,
    every heartbeat on every worker); with it, the tenants' look is one pipeline more."""
    with Client(queue.server.url, queue.ns) as client:
        for k in range(200):
            client.add_lora(f"adapter-{k:03d}", simulated_adapter(tmp_path, f"adapter-{k:03d}"), BASE)
        settings = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, max_loras=2)
        adapters = Adapters(queue.r, queue.keys, _engine(2), BASE, settings, ServerClock(queue.r), NullMetrics())
        assert len(adapters.start([])) == 200
        client.submit("cold", lora="adapter-199", max_tokens=2)

    def sent(fair: bool) -> dict[str, int]:  # commands by name, the script's own calls counted apart
        def counts() -> dict[str, int]:
            return {k: v["calls"] for k, v in queue.r.info("commandstats").items()}

        before = counts()
        adapters.check_aging(fair)
        return {k: n - before.get(k, 0) for k, n in counts().items() if n != before.get(k, 0)}

    adapters.check_aging(fair=False)  # the script loaded
    without = sent(fair=False)
    assert without.get("cmdstat_evalsha", 0) + without.get("cmdstat_eval", 0) == 1, without
    assert "cmdstat_zrange" not in without and set(adapters.waiting) == {"adapter-199"}
    assert sent(fair=True)["cmdstat_zrange"] == 600 and set(adapters.waiting) == {"adapter-199"}


def test_the_look_asks_xinfo_only_of_streams_holding_entries_and_survives_a_key_of_another_type(queue, tmp_path):
    """Most of the 600 streams of 200 adapters hold nothing (other priorities, idle adapters): the look asked each its
    groups (XINFO GROUPS), 5 ms of Redis a look, every heartbeat on every worker. It asks XLEN first now. A key of
    another type at a stream's name (a hostile producer's SET) made the look's XRANGE fail, and the heartbeat with it:
    it is skipped now."""
    with Client(queue.server.url, queue.ns) as client:
        for k in range(200):
            client.add_lora(f"adapter-{k:03d}", simulated_adapter(tmp_path, f"adapter-{k:03d}"), BASE)
        settings = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, max_loras=2)
        adapters = Adapters(queue.r, queue.keys, _engine(2), BASE, settings, ServerClock(queue.r), NullMetrics())
        adapters.start([])
        for k in range(200):  # every stream made, as a worker's groups make them
            for priority in ("high", "normal", "low"):
                queue.r.xgroup_create(queue.keys.jobs(f"adapter-{k:03d}", priority), Keys.GROUP, id="0",
                                      mkstream=True)
        client.submit("one", lora="adapter-007", max_tokens=2)
        client.submit("two", lora="adapter-199", max_tokens=2)
    queue.r.delete(queue.keys.jobs("adapter-100", "low"))
    queue.r.set(queue.keys.jobs("adapter-100", "low"), "not a stream")
    adapters.check_aging(fair=False)  # the script loaded

    def xinfo_calls() -> int:
        return sum(v["calls"] for k, v in queue.r.info("commandstats").items() if k.startswith("cmdstat_xinfo"))

    before = xinfo_calls()
    adapters.check_aging(fair=False)
    assert xinfo_calls() - before == 2  # the two streams with a job, of 600
    assert adapters.backlog == {"adapter-007": 1, "adapter-199": 1}


def test_adapters_with_more_jobs_waiting_come_first_more_often_and_workers_draw_different_orders(queue, tmp_path):
    """Longest-waiting first, every worker of a fleet looked at the same few adapters first (in a backlog all waited
    about as long): the first took their jobs, the others read nothing, and adapters late in that order kept their
    jobs in Redis while workers had free slots (W-LORA's fleet ran at half the base fleet's jobs/s). Each worker now
    draws its order weighted by the jobs waiting: a backlog of 9 comes first 9 times as often as one of 1."""
    with Client(queue.server.url, queue.ns) as client:
        for name in ("hot", "cold", "other"):
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
        client.submit("cold's", lora="cold", max_tokens=2)  # the oldest job: first by age, every time
        client.submit("other's", lora="other", max_tokens=2)
        for i in range(9):
            client.submit(f"hot {i}", lora="hot", max_tokens=2)
    settings = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, max_loras=1)
    workers = [Adapters(queue.r, queue.keys, _engine(1), BASE, settings, ServerClock(queue.r), NullMetrics())
               for _ in range(2)]
    for k, adapters in enumerate(workers):
        adapters.rng = random.Random(k)
        adapters.start([])
        adapters.check_aging(fair=False)
    assert workers[0].backlog == {"hot": 9, "cold": 1, "other": 1}
    firsts = [workers[0].order_waiting(["cold", "other", "hot"])[0] for _ in range(1100)]
    assert 850 <= firsts.count("hot") <= 950, firsts.count("hot")  # 9 / 11 of 1,100 draws: 900
    assert 60 <= firsts.count("cold") <= 140 and 60 <= firsts.count("other") <= 140  # 100 each
    orders = {tuple(w.order_waiting(["cold", "other", "hot"])) for w in workers for _ in range(20)}
    assert len(orders) > 1  # not one order for the whole fleet


def test_adapters_aged_while_slots_were_pinned_are_all_read_once_the_slots_are_free(queue, tmp_path):
    """Aged at a heartbeat (no room here then), an adapter was left to the one aged adapter a read takes, even after
    slots freed: a backlog's tail, aged all at once, stayed in Redis a heartbeat long while the worker had free
    slots. Room now makes them ordinary candidates again: as many as slots are spare."""
    from kvgate.engine.sampling_params import SamplingParams

    engine = _engine(4)
    with Client(queue.server.url, queue.ns) as client:
        for name in [f"busy-{k}" for k in range(4)] + [f"late-{k}" for k in range(4)]:
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
        settings = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, max_loras=4, lora_aging_ms=100)
        adapters = Adapters(queue.r, queue.keys, engine, BASE, settings, ServerClock(queue.r), NullMetrics())
        adapters.start([])
        for k in range(4):
            engine.loras.add(f"busy-{k}", adapters.paths[f"busy-{k}"])
            engine.add_request(f"r{k}", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), lora=f"busy-{k}")
        engine.step()  # four adapters pin the four slots
        for k in range(4):
            client.submit(f"late {k}", lora=f"late-{k}", max_tokens=2)
        time.sleep(0.2)  # past the aging bound
        adapters.check_aging(fair=False)
    assert adapters.aged == {f"late-{k}" for k in range(4)}
    while engine.has_unfinished():
        engine.step()
    assert engine.loras.spare() == 4
    read = adapters.readable((BASE,))
    assert {f"late-{k}" for k in range(4)} <= set(read), read  # besides the four idle ones loaded here


@pytest.mark.parametrize("server", ["queue", "queue62"])
def test_an_adapters_jobs_parked_for_deadline_order_count_as_waiting_for_the_other_workers(server, request, tmp_path):
    """A read parks up to deadline_window new jobs of a stream in its due index (worker/due.py): delivered, so the
    group's lag no longer counts them. A heartbeat's look that saw only the lag took them for none: the hottest
    adapters' last jobs, parked 64 at a time, were served by the few workers holding the adapter while the others
    stood idle (W-LORA's fleet: seconds of tail with jobs waiting)."""
    from kvgate.worker.read_plan import ReadPlan
    from kvgate.worker.reader import Reader

    queue = request.getfixturevalue(server)  # Redis 7, and 6.2 (whose XINFO GROUPS tells no lag)
    with Client(queue.server.url, queue.ns) as client:
        client.add_lora("parked", simulated_adapter(tmp_path, "parked"), BASE)
        for i in range(5):
            client.submit(f"job {i}", lora="parked", max_tokens=2)
    stream = queue.keys.jobs("parked", "normal")
    holder = Reader(queue.r, "holder", ReadPlan([stream]), keys=queue.keys, deadline_window=64)
    assert len(holder.read(1)) == 1  # one taken, the other four parked
    assert queue.r.zcard(queue.keys.due_index(stream)) == 4
    assert queue.r.xinfo_groups(stream)[0].get("lag", 0) == 0
    settings = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, max_loras=1)
    other = Adapters(queue.r, queue.keys, _engine(1), BASE, settings, ServerClock(queue.r), NullMetrics())
    other.start([])
    other.check_aging(fair=False)
    assert other.backlog == {"parked": 4} and "parked" in other.waiting
    assert "parked" in other.readable((BASE,))


def test_an_adapter_already_in_host_memory_comes_first_more_often_than_one_read_from_disk(queue, tmp_path):
    """A job of an adapter new to a worker waits for its read from disk (W-LORA's fleet: a tenth of the sequences
    stood idle behind reads mid-run); one in host memory is a slot load away. Of two adapters with as many jobs
    waiting, the one in host memory comes first IN_HOST_WEIGHT times as often."""
    from kvgate.worker.adapters import IN_HOST_WEIGHT

    engine = _engine(2)
    with Client(queue.server.url, queue.ns) as client:
        for name in ("known", "new"):
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
            client.submit(f"{name}'s", lora=name, max_tokens=2)
    settings = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, max_loras=2)
    adapters = Adapters(queue.r, queue.keys, engine, BASE, settings, ServerClock(queue.r), NullMetrics())
    adapters.rng = random.Random(7)
    adapters.start([])
    engine.loras.add("known", adapters.paths["known"])  # read here before: in host memory, in no slot
    adapters.check_aging(fair=False)
    assert adapters.backlog == {"known": 1, "new": 1} and engine.loras.loaded == {}
    firsts = [adapters.order_waiting(["new", "known"])[0] for _ in range(1000)]
    share = IN_HOST_WEIGHT / (IN_HOST_WEIGHT + 1)
    assert abs(firsts.count("known") / 1000 - share) < 0.05, firsts.count("known")


def test_the_registry_is_parsed_again_only_when_it_changed(queue, tmp_path, monkeypatch):
    """Each heartbeat reads the registry: 200 adapters' JSON parsed on every worker every second, for nothing when no
    adapter was added or removed. A registry as last read is not parsed again; a change still is."""
    import kvgate.worker.adapters as module

    parsed = []
    real = module.parse_lora_entry
    monkeypatch.setattr(module, "parse_lora_entry", lambda value: parsed.append(value) or real(value))
    with Client(queue.server.url, queue.ns) as client:
        for name in ("a", "b"):
            client.add_lora(name, simulated_adapter(tmp_path, name), BASE)
        settings = WorkerSettings(redis_url=queue.server.url, namespace=queue.ns, max_loras=1)
        adapters = Adapters(queue.r, queue.keys, _engine(1), BASE, settings, ServerClock(queue.r), NullMetrics())
        assert adapters.start([]) == ["a", "b"] and len(parsed) == 2
        assert adapters.refresh() == [] and len(parsed) == 2  # unchanged: not parsed
        client.add_lora("c", simulated_adapter(tmp_path, "c"), BASE)
        assert adapters.refresh() == ["c"] and len(parsed) == 5
        client.remove_lora("a")
        assert adapters.refresh() == [] and "a" not in adapters.paths and len(parsed) == 8
