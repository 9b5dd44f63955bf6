"""WorkerMetrics: hooks turn engine figures into the Prometheus series the dashboard and alerts read."""
from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from kvgate.worker.metrics import WorkerMetrics
from tests.support import free_port


@dataclass
class Stats:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 100
    total_blocks: int = 100
    kv_usage: float = 0.0
    preemptions: int = 0
    stepped_aside: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


def value(m: WorkerMetrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, {**m.labels, **labels})


def test_cumulative_engine_figures_become_counter_increments_without_double_counting():
    m = WorkerMetrics("w1", "tiny")
    m.on_step(Stats(running=3, waiting=1, free_blocks=40, kv_usage=0.6, preemptions=2, prompt_tokens=100,
                    generation_tokens=10, prefix_hit_tokens=32, prefix_query_tokens=64), 0.01, waiting_local=4)
    m.on_step(Stats(running=2, free_blocks=50, kv_usage=0.5, preemptions=2, prompt_tokens=100,
                    stepped_aside=3, generation_tokens=13, prefix_hit_tokens=32, prefix_query_tokens=128), 0.02, waiting_local=0)
    assert value(m, "kvgate_preemptions_total") == 2
    assert value(m, "kvgate_stepped_aside_total") == 3
    assert value(m, "kvgate_generation_tokens_total") == 13
    assert value(m, "kvgate_prompt_tokens_total") == 100
    assert value(m, "kvgate_prefix_cache_hit_ratio") == 0.25
    assert value(m, "kvgate_requests_running") == 2
    assert value(m, "kvgate_requests_waiting_local") == 0
    assert value(m, "kvgate_kv_free_blocks") == 50
    assert value(m, "kvgate_kv_cache_usage_ratio") == 0.5
    assert value(m, "kvgate_engine_step_seconds_count") == 2


def test_an_engine_restart_resets_cumulative_figures_without_negative_increments():
    m = WorkerMetrics("w1", "tiny")
    m.on_step(Stats(generation_tokens=50), 0.01, 0)
    m.on_step(Stats(generation_tokens=5), 0.01, 0)
    assert value(m, "kvgate_generation_tokens_total") == 55


def test_latency_hooks_fill_histograms_and_status_counters():
    m = WorkerMetrics("w1", "tiny")
    m.on_admitted(0.003)
    m.on_first_token(0.2)
    m.on_finished("done", 2.0, 0.02, prompt_tokens=10, completion_tokens=100, cached_tokens=8)
    m.on_finished("error", 0.01, None, prompt_tokens=0, completion_tokens=0, cached_tokens=0)
    m.on_redelivery()
    m.on_dead_letter("max_deliveries")
    assert value(m, "kvgate_jobs_admitted_total") == 1
    assert value(m, "kvgate_queue_wait_seconds_bucket", le="0.005") == 1
    assert value(m, "kvgate_time_to_first_token_seconds_bucket", le="0.1") == 0
    assert value(m, "kvgate_time_to_first_token_seconds_bucket", le="0.25") == 1
    assert value(m, "kvgate_time_per_output_token_seconds_count") == 1
    assert value(m, "kvgate_e2e_request_latency_seconds_count") == 2
    assert value(m, "kvgate_jobs_finished_total", status="done") == 1
    assert value(m, "kvgate_jobs_finished_total", status="error") == 1
    assert value(m, "kvgate_jobs_finished_total", status="cancelled") == 0
    assert value(m, "kvgate_redeliveries_total") == 1
    assert value(m, "kvgate_dead_letters_total", reason="max_deliveries") == 1
    assert value(m, "kvgate_request_cached_tokens_total") == 8


def test_two_workers_in_one_process_keep_separate_registries():
    a, b = WorkerMetrics("a", "m"), WorkerMetrics("b", "m")
    a.on_redelivery()
    assert value(a, "kvgate_redeliveries_total") == 1
    assert value(b, "kvgate_redeliveries_total") == 0


def test_serve_exposes_the_registry_over_http():
    port = free_port()
    m = WorkerMetrics("w-http", "tiny")
    m.on_admitted(0.5)
    m.serve(port)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    assert 'kvgate_jobs_admitted_total{model="tiny",worker="w-http"} 1.0' in body


def test_finished_jobs_are_counted_by_tenant_with_at_most_32_tenant_labels_per_worker():
    m = WorkerMetrics("w1", "tiny")
    m.on_finished("done", 1.0, 0.01, prompt_tokens=3, completion_tokens=7, cached_tokens=0, tenant="team-a")
    m.on_finished("error", 0.1, None, prompt_tokens=0, completion_tokens=0, cached_tokens=0)  # an old producer's job
    for k in range(40):  # a producer inventing tenants: 31 more get labels, the other 9 share one
        m.on_finished("done", 1.0, 0.01, prompt_tokens=1, completion_tokens=2, cached_tokens=0, tenant=f"t{k}")
    assert value(m, "kvgate_tenant_jobs_finished_total", tenant="team-a", status="done") == 1
    assert value(m, "kvgate_tenant_generation_tokens_total", tenant="team-a") == 7
    assert value(m, "kvgate_tenant_jobs_finished_total", tenant="_none", status="error") == 1
    assert value(m, "kvgate_tenant_jobs_finished_total", tenant="t30", status="done") == 1
    assert value(m, "kvgate_tenant_jobs_finished_total", tenant="t31", status="done") is None
    assert value(m, "kvgate_tenant_jobs_finished_total", tenant="_other", status="done") == 9
    tenants = {s.labels["tenant"] for f in m.registry.collect() if f.name == "kvgate_tenant_jobs_finished"
               for s in f.samples}
    assert len(tenants) == 34  # 32 tenants, _none, _other
