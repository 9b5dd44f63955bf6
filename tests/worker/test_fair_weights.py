"""Tenants' fair-share weights (worker/tenant_weights.py) and the share arithmetic that uses them (worker/fair.py):
one declared range, enforced where a weight is set, a weight out of it in Redis never stops a worker, and shares are
numbers whatever a weight is. And the tenants' streams a drain leaves empty go in about the time their deletion
takes, not one slice per trim interval."""
from __future__ import annotations

import logging
import math
import sys

import pytest

from kvgate.producer.keys import Keys
from tests.support import wait_for
from tests.worker.test_fair import band, done, enqueue, occupancy

EXTREMES = [0.0, -0.0, -1.0, 5e-324, 1e-308, 1e-300, 1e-4, 2e3, 1e300, 1e308, sys.float_info.max,
            math.inf, -math.inf, math.nan]


def test_a_tenant_weight_of_1e_308_in_the_namespaces_hash_does_not_stop_a_worker_its_jobs_fill(queue, thread_worker):
    """As found: `HSET {ns}:tenants tiny 1e-308` passed the hash's check (a positive number), and once tiny's jobs
    were alone on a full worker its preempting look computed tiny's share as 5 / 1e-308 * 1e-308 = inf and
    math.floor(inf) raised OverflowError: the worker's thread died and the next tenant's job waited forever."""
    from kvgate.engine.simulated import SimulatedEngine

    queue.r.set(queue.keys.fair(), 1)
    queue.r.hset(queue.keys.tenants(), mapping={"tiny": "1e-308"})
    tiny = enqueue(queue, "tiny", 6, max_tokens=150, ignore_eos=True)
    engine = SimulatedEngine(num_blocks=512, block_size=16, max_num_seqs=4, step_overhead_s=0.01, per_token_s=0.0)
    running = thread_worker(engine=engine, fair_preempt_ms=30)
    with running:
        wait_for(lambda: engine.stats.running == 4, 10, "tiny's jobs filling every seat")
        other = enqueue(queue, "other", 1, max_tokens=4, ignore_eos=True)
        wait_for(lambda: done(queue, other) == 1 or not running.thread.is_alive(), 30, "the other tenant's job")
        assert running.thread.is_alive(), "the worker's thread died"
        queue.wait_finals(7, timeout=60)
    assert sorted(f.job_id for f in queue.finals()) == sorted(tiny + other)  # each once


@pytest.mark.parametrize("value, shown", [("1e-308", "1e-308"), ("0.0009", "0.0009"), ("1000.5", "1000.5"),
                                          ("1e300", "1e+300"), ("inf", "inf"), ("nan", "nan"), ("0", "0")])
def test_a_weights_file_with_a_weight_outside_the_range_stops_the_start_naming_value_and_range(tmp_path, value,
                                                                                              shown):
    """The file is where 1e-308 was found first: `kvgate worker --tenant-weights` wrote it to `{ns}:tenants` and
    every worker serving that tenant died. It is refused at start, saying the value, the range and what to do."""
    from pydantic import ValidationError

    from kvgate.worker.settings import WorkerSettings

    path = tmp_path / "weights.toml"
    path.write_text(f"[weights]\nteam-a = 2\ntiny = {value}\n")
    with pytest.raises(ValidationError) as caught:
        WorkerSettings(tenant_weights=str(path))
    says = str(caught.value)
    assert f"tenant weights file {path}: tiny: weight {shown} must be a number from 0.001 to 1000" in says
    assert "set it within that range" in says, says


def test_a_weights_file_takes_the_ends_of_the_range():
    from kvgate.worker.tenant_weights import MAX_WEIGHT, MIN_WEIGHT, check_weight

    assert (MIN_WEIGHT, MAX_WEIGHT) == (0.001, 1000.0)
    assert check_weight(0.001) is None and check_weight(1000) is None and check_weight(1) is None


def test_a_weight_outside_the_range_in_the_namespaces_hash_is_clamped_and_logged_once(queue, caplog):
    """The hash is the operator's, read with every heartbeat: a number outside the range is clamped to its nearer
    end (a tiny weight stays the least share there is), what is no positive number counts as 1, as before; each
    such entry is logged once, with its value, not every heartbeat."""
    from kvgate.worker.fair import Fair

    queue.r.hset(queue.keys.tenants(), mapping={"tiny": "1e-308", "huge": "1e300", "ok": "2", "typo": "two",
                                                 "zero": "0", "inf": "inf"})
    fair = Fair(queue.r, queue.keys, "keep")
    with caplog.at_level(logging.WARNING, logger="kvgate.worker"):
        fair.sync()
        fair.sync()  # as the next heartbeat does
    assert fair.weights == {"tiny": 0.001, "huge": 1000.0, "ok": 2.0}
    lines = [r.getMessage() for r in caplog.records if "tenant weights in" in r.getMessage()]
    assert len(lines) == 1, lines
    for shown in ("tiny=1e-308 (as 0.001)", "huge=1e300 (as 1000)", "typo=two (as 1)", "zero=0 (as 1)",
                  "inf=inf (as 1)", "0.001 to 1000"):
        assert shown in lines[0], lines[0]
    queue.r.hset(queue.keys.tenants(), "tiny", "0.5")
    with caplog.at_level(logging.WARNING, logger="kvgate.worker"):
        fair.sync()
    assert fair.weights["tiny"] == 0.5
    assert len([r for r in caplog.records if "tenant weights in" in r.getMessage()]) == 2  # what changed, again


@pytest.mark.parametrize("w", EXTREMES)
def test_shares_of_a_workers_jobs_are_numbers_whatever_a_weight_is(w):
    """Occupancy is total: no OverflowError, ZeroDivisionError or nan for any float a weight may be, alone or
    beside others, whoever asks."""
    for other in (1.0, *EXTREMES):
        for counts in ({"x": 1}, {"x": 4}, {"x": 3, "y": 1}, {"y": 2}, {}):
            here = occupancy(counts, ("x",), {"x": w, "y": other})
            for t in (None, "x", "y", "z"):
                assert math.isfinite(here.share(t)) and math.isfinite(here.per_weight(t)), (w, other, counts, t)
                assert isinstance(here.room(t), int)
                assert set(here.over(t)) <= set(counts)
                assert here.makes_room(t) in (True, False)


@pytest.mark.parametrize("w", EXTREMES)
def test_counters_move_by_numbers_whatever_a_weight_is(w):
    """What a job's end corrects on its tenant's counters (and, on a cluster, what its read charged) divides by
    the weight: a number for any float, never a ZeroDivisionError."""
    from kvgate.worker.fair import Fair

    keys = Keys("ns")
    stream = keys.jobs(None, "normal")
    fair = Fair(None, keys, "keep", {stream}, weights={"x": w})
    fair.charged[f"{Keys.tenant_jobs(stream, 'x')}|1-0"] = 512.0
    fair.finished(Keys.tenant_jobs(stream, "x"), "1-0", "x", 16)
    assert all(math.isfinite(v) for pair in fair.served.values() for v in pair), fair.served


def test_tenants_streams_a_drain_left_empty_go_without_a_trim_interval_per_slice(queue, thread_worker):
    """A pruning pass looks at 64 tenants' streams per band; one pass per --trim-interval-s left 50,000 tenants'
    emptied streams an hour (48,465 streams, 84 MB after the drain at 5 s). A pass whose slice was full sweeps again
    soon, so streams a drain emptied go as fast as their deletion runs. The interval here, an hour, stands for
    that hour: only the passes that follow full slices can delete them within the test."""
    from kvgate.worker.fair_sweep import SWEEP_TENANTS

    queue.r.set(queue.keys.fair(), 1)
    tenants = [f"t{i}" for i in range(SWEEP_TENANTS * 5)]
    ids = [i for t in tenants for i in enqueue(queue, t, 1, max_tokens=2)]
    streams = [Keys.tenant_jobs(band(queue), t) for t in tenants]
    with thread_worker(reclaim_idle_ms=200, trim_interval_s=3600):
        wait_for(lambda: done(queue, ids) == len(ids), 60, "every tenant's job served")
        wait_for(lambda: queue.r.exists(*streams) == 0, 30, "the emptied tenants' streams deleted")
        assert queue.r.zcard(Keys.fair_streams(band(queue))) == 0


def test_a_sweep_says_there_is_more_when_a_bands_slice_was_full(queue):
    from kvgate.worker.fair import Fair
    from kvgate.worker.fair_sweep import SWEEP_TENANTS

    r, b = queue.r, band(queue)
    r.zadd(Keys.fair_streams(b), {f"t{i}": 0 for i in range(SWEEP_TENANTS + 1)})  # streams gone: forgotten
    fair = Fair(r, queue.keys, "keep", {b})
    assert fair.sweep(100, "me").more
    assert not fair.sweep(100, "me").more  # one left
    assert r.zcard(Keys.fair_streams(b)) == 0
