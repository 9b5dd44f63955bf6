"""Multi-model fleets: each model has its own streams; a worker serves its name, its aliases and `default`."""
from __future__ import annotations

import argparse
import time

import pytest

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer import Client
from kvgate.commands.stats import NO_WORKER, render
from kvgate.producer.keys import PRIORITIES, Keys
from kvgate.producer.protocol import encode
from kvgate.producer.model_set import add_models
from kvgate.producer.queue_stats import read_queue_stats
from kvgate.producer.steps import run
from tests.support import wait_for

SIM = ("--simulated", "--sim-step-ms", "1", "--sim-per-token-ms", "0.01")


def _heartbeats(r, keys: Keys, n: int) -> dict[str, dict]:
    def beats():
        found = {k: r.hgetall(k) for k in (keys.worker(i.decode()) for i in r.zrange(keys.workers(), 0, -1))}
        return found if len(found) >= n else None

    return wait_for(beats, 60, f"{n} worker heartbeats")


def test_each_model_is_answered_only_by_workers_serving_it_and_default_jobs_by_a_default_server(
        redis_server, namespace, spawn):
    url, keys, r = redis_server.url, Keys(namespace), redis_server.client()
    spawn(url, namespace, *SIM, "--served-model-name", "alpha", "--model-alias", "a1", "--no-serve-default",
          worker_id="w-alpha")
    spawn(url, namespace, *SIM, "--served-model-name", "org/beta", worker_id="w-beta")
    beats = _heartbeats(r, keys, 2)
    assert {b[b"models"] for b in beats.values()} == {b"alpha,a1", b"org/beta,default"}
    with Client(url, namespace) as client:
        asks = {"alpha": "alpha", "a1": "alpha", "org/beta": "org/beta", None: "org/beta"}
        handles = {ask: [client.submit("hi", model=ask, max_tokens=3) for _ in range(4)] for ask in asks}
        for ask, served in asks.items():
            for h in handles[ask]:
                result = h.result(timeout=60)
                assert result.status == "done" and result.model == served, (ask, result)
                assert result.worker == ("w-alpha" if served == "alpha" else "w-beta")
    assert {m.decode() for m in r.smembers(keys.models())} == {"alpha", "a1", "org/beta", "default"}
    assert r.xlen(keys.jobs("a1", "normal")) >= 0 and r.exists(keys.jobs("org/beta", "normal"))


def test_a_job_for_a_model_nobody_serves_waits_shows_in_stats_and_is_answered_once_a_worker_starts(
        redis_server, namespace, spawn):
    url, keys, r = redis_server.url, Keys(namespace), redis_server.client()
    spawn(url, namespace, *SIM, "--served-model-name", "alpha", worker_id="w-alpha")
    _heartbeats(r, keys, 1)
    run(add_models(r, keys, ["gamma"]))  # an operator's `kvgate models add gamma`: its backlog is seen before a worker
    with Client(url, namespace) as client:
        waiting = client.submit("wait for me", model="gamma", max_tokens=2, priority="high")
        assert client.submit("now", model="alpha", max_tokens=2).result(timeout=60).model == "alpha"
        time.sleep(0.5)  # the live worker had every chance to take the gamma job: it must not
        assert waiting.status().state == "queued" and client.get(waiting.job_id) is None
        stats = client.stats()
        gamma = stats.models["gamma"]
        assert gamma.backlog == 1 and gamma.priorities["high"].backlog == 1 and gamma.workers == []
        assert gamma.waiting_for_workers and not stats.models["alpha"].waiting_for_workers
        assert stats.models["alpha"].workers == ["w-alpha"]
        screen = render(stats, namespace)
        assert next(line for line in screen.splitlines() if line.startswith("gamma")).endswith(NO_WORKER)
        spawn(url, namespace, *SIM, "--served-model-name", "gamma", "--no-serve-default", worker_id="w-gamma")
        result = waiting.result(timeout=60)
    assert result.status == "done" and result.model == "gamma" and result.worker == "w-gamma"
    assert read_queue_stats(r, keys).models["gamma"].backlog == 0


def test_a_tight_kv_budget_admits_by_capacity_across_all_the_streams_a_worker_serves(queue, thread_worker):
    engine = SimulatedEngine(num_blocks=5, block_size=16, max_num_seqs=8, step_overhead_s=0.002)
    # a 40-token prompt takes 3 of the 5 blocks, so one job runs at a time, plus 2 in the local queue;
    # max_num_seqs alone would let 8 + 2 in
    bound = 1 + 2
    held_most = 0
    names = ["m1", "m2", "default"]
    with thread_worker(engine, served_model_name="m1", model_aliases=["m2"], local_queue_size=2):
        ids = [queue.submit("x " * 40, max_tokens=30, model=names[i % 3] if i % 3 < 2 else None,
                            priority=PRIORITIES[i % 3]) for i in range(30)]
        deadline = time.monotonic() + 60
        while len(queue.finals()) < 30 and time.monotonic() < deadline:
            held = sum(queue.pending(p, m) for p in PRIORITIES for m in names)
            held_most = max(held_most, held)
            time.sleep(0.005)
        finals = queue.finals()
    assert sorted(f.job_id for f in finals) == sorted(ids) and {f.status for f in finals} == {"done"}
    assert {f.model for f in finals} == {"m1"}
    assert 0 < held_most <= bound, f"held {held_most} jobs at once; the KV budget and local queue allow {bound}"


def test_high_priority_jobs_of_any_served_model_are_admitted_before_low_ones(queue, thread_worker):
    lows = [queue.submit("low", max_tokens=4, model="m1", priority="low") for _ in range(3)]
    highs = [queue.submit("high", max_tokens=4, model="m2", priority="high") for _ in range(3)]
    engine = SimulatedEngine(num_blocks=256, block_size=16, max_num_seqs=1, step_overhead_s=0.005)
    with thread_worker(engine, served_model_name="m1", model_aliases=["m2"], serve_default=False):
        finals = {f.job_id: f for f in queue.wait_finals(6)}
    assert max(finals[j].timings.admitted for j in highs) < min(finals[j].timings.admitted for j in lows)


def test_models_of_one_priority_take_turns_at_being_read_first(queue, thread_worker):
    """With room for one job at a time, a model whose stream is always full must not starve another."""
    for i in range(12):
        queue.submit(f"busy {i}", max_tokens=2, model="busy")
    quiet = queue.submit("quiet", max_tokens=2, model="quiet")
    engine = SimulatedEngine(num_blocks=256, block_size=16, max_num_seqs=1, step_overhead_s=0.005)
    with thread_worker(engine, served_model_name="busy", model_aliases=["quiet"], serve_default=False,
                       local_queue_size=2):
        finals = queue.wait_finals(13)
    order = [f.job_id for f in sorted(finals, key=lambda f: f.timings.admitted)]
    assert order.index(quiet) < 6, f"the quiet model's job was admitted {order.index(quiet) + 1}th of 13"


def test_a_raw_job_with_a_bad_model_name_gets_an_error_result_that_names_it(queue, thread_worker):
    job = queue.job("hi")
    job.model = "two words"
    queue.xadd(encode(job))
    with thread_worker():
        (final,) = queue.wait_finals(1)
    assert final.status == "error" and "model name 'two words'" in final.error and "whitespace" in final.error


def test_aliases_come_from_repeated_flags_or_a_comma_separated_variable_and_bad_names_stop_the_worker(monkeypatch):
    from kvgate.commands.worker import WorkerStartError, add_arguments, settings_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    s = settings_from(parser.parse_args(["--model-alias", "qwen", "--model-alias", "org/q7,q7b",
                                         "--served-model-name", "Qwen/Qwen2.5-7B", "--no-serve-default"]))
    assert s.model_aliases == ["qwen", "org/q7", "q7b"] and s.served_model_name == "Qwen/Qwen2.5-7B"
    assert s.serve_default is False
    monkeypatch.setenv("KVGATE_MODEL_ALIASES", "a, b")
    assert settings_from(parser.parse_args([])).model_aliases == ["a", "b"]
    with pytest.raises(WorkerStartError, match=r"--model-alias \['bad name'\].*whitespace"):
        settings_from(parser.parse_args(["--model-alias", "bad name"]))
    monkeypatch.setenv("KVGATE_SERVED_MODEL_NAME", "{x}")
    with pytest.raises(WorkerStartError, match="KVGATE_SERVED_MODEL_NAME='{x}'.*braces"):
        settings_from(parser.parse_args([]))


def test_an_engine_name_that_is_no_valid_model_name_asks_for_served_model_name():
    from kvgate.worker.served import ServedModelError, served_models

    with pytest.raises(ServedModelError, match="--served-model-name"):
        served_models("/models/My Model.gguf", None, [], True)
    served = served_models("/models/My Model.gguf", "mine", ["m", "mine"], True)
    assert served.canonical == "mine" and served.names == ("mine", "m", "default")
    assert served_models("x", None, [], False).names == ("x",)
