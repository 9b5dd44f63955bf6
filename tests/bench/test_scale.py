"""W-SCALE's simulator (kvgate/bench/scale.py) and the KEDA and HPA rules it follows (kvgate/bench/scale_policy.py),
at a small scale: each rule is checked against the number the HPA's or KEDA's documented arithmetic gives."""
from __future__ import annotations

from kvgate.bench.scale import Fleet, Trace, smallest
from kvgate.bench.scale_policy import Autoscaler, Behavior, Gauges, Policy, Trigger, WorkScaling

TRIGGERS = {"a": Trigger("a", "", 100.0), "b": Trigger("b", "", 10.0)}


def scaler(**behavior) -> Autoscaler:
    return Autoscaler(Behavior(**behavior), TRIGGERS)


def test_the_hpa_asks_for_the_largest_ceil_of_value_over_target_and_holds_within_its_tolerance():
    s = scaler()
    assert s.desired({"a": 250.0, "b": 12.0}, current=1) == 3  # ceil(250 / 100) beats ceil(12 / 10)
    assert s.desired({"a": 0.0, "b": 0.0}, current=4) == 0
    assert s.desired({"a": 1050.0, "b": 0.0}, current=10) == 10  # 1050 / (100 x 10) = 1.05: within 10%
    assert s.desired({"a": 1150.0, "b": 0.0}, current=10) == 12


def test_scale_up_is_limited_by_the_policy_that_allows_most_per_period():
    s = scaler(up_policies=(Policy("Pods", 4, 60), Policy("Percent", 100, 60)), polling_s=15)
    values = {"a": 5000.0, "b": 0.0}  # 50 workers wanted
    assert s.replicas(0, values, 1) == 5  # from 1: +4 pods beats +100% (2)
    assert s.replicas(15, values, 5) == 5  # the period's 4 pods are spent
    assert s.replicas(60, values, 5) == 10  # a new period from 5: +100% (10) beats +4 (9)
    assert s.replicas(120, values, 10) == 20


def test_scale_down_waits_out_the_stabilisation_window_then_follows_its_policy():
    s = scaler(down_window_s=300, down_policies=(Policy("Percent", 50, 60),), cooldown_s=10_000)
    assert s.replicas(0, {"a": 1600.0, "b": 0.0}, 16) == 16
    for t in range(15, 300, 15):  # asking for 1 worker, but the window still holds the ask for 16
        assert s.replicas(t, {"a": 100.0, "b": 0.0}, 16) == 16
    assert s.replicas(300, {"a": 100.0, "b": 0.0}, 16) == 8  # then half per minute
    assert s.replicas(315, {"a": 100.0, "b": 0.0}, 8) == 8
    assert s.replicas(360, {"a": 100.0, "b": 0.0}, 8) == 4


def test_one_job_wakes_a_fleet_at_zero_and_it_goes_back_to_zero_after_the_cooldown():
    s = scaler(cooldown_s=300)
    assert s.replicas(0, {"a": 0.0, "b": 0.0}, 0) == 0  # nothing active: stays at zero
    assert s.replicas(15, {"a": 0.0, "b": 0.5}, 0) == 1  # one trigger above its activation 0
    assert s.replicas(30, {"a": 0.0, "b": 0.0}, 1) == 1  # the HPA keeps one while KEDA cools down
    assert s.replicas(314, {"a": 0.0, "b": 0.0}, 1) == 1
    assert s.replicas(315, {"a": 0.0, "b": 0.0}, 1) == 0


def test_work_triggers_pace_deadline_work_and_drain_interactive_work():
    w = WorkScaling(worker_tokens_per_s=1000, deadline_margin=0.5, utilisation=0.8, drain_s=60)
    v = w.values(Gauges(jobs=10, tokens_waiting={"high": 6000.0, "low": 1e6}, deadline_rate_needed=2000.0,
                        tokens_per_s=4000.0))
    assert v == {"deadline": 4000.0, "work": 100.0, "wake": 1}  # the served rate counts only with no deadline
    v = w.values(Gauges(jobs=0, tokens_waiting={}, deadline_rate_needed=0.0, tokens_per_s=4000.0))
    assert v == {"deadline": 0.0, "work": 5000.0, "wake": 0}


def test_a_small_batch_ends_inside_its_window_on_work_and_costs_less_than_scaling_on_job_counts():
    trace = Trace(seed=1, day_s=3600.0, interactive_per_s=0.2, batch_lines=3000, batch_tokens=(400, 800),
                  window_s=900.0, batch_at=600.0)
    fleet = dict(cold_start_s=30.0)
    work, lag = Fleet(trace, "work", **fleet).run(), Fleet(trace, "lag", **fleet).run()
    assert work["batch_done"] == lag["batch_done"] == 3000
    assert work["batch_on_time"] >= 0.995 and lag["batch_on_time"] >= 0.995
    assert work["worker_minutes"] < lag["worker_minutes"]
    alone = Fleet(trace, "work", **fleet).run(batch=False)
    assert alone["batch_on_time"] is None and alone["max_replicas"] < work["max_replicas"]


def test_a_fleet_at_zero_serves_a_lone_job_after_one_cold_start():
    trace = Trace(seed=3, day_s=600.0, interactive_per_s=0.0, batch_lines=1, batch_tokens=(500, 500),
                  window_s=300.0, batch_at=100.0)
    r = Fleet(trace, "work", cold_start_s=90.0).run()
    assert r["batch_done"] == 1 and r["batch_on_time"] == 1.0 and r["max_replicas"] == 1
    assert 90 <= r["worker_minutes"] * 60  # the pod's cold start counts


def test_the_constant_fleet_search_finds_the_least_size_that_meets():
    assert smallest(lambda n: n * n >= 50) == 8
    assert smallest(lambda n: True) == 1


def test_kvgate_bench_scale_is_a_registered_benchmark_with_the_issues_trace_by_default():
    from kvgate.bench import scale
    from kvgate.commands.cli import build_parser

    args = build_parser().parse_args(["bench", "scale"])
    assert args.bench == "scale" and args._run is scale.run
    assert (args.batch_lines, args.window_s, args.cold_start_s) == (50_000, 3600.0, 90.0)
