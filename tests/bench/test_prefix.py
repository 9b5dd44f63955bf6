"""W-PREFIX harness: a tiny run of each contestant answers every job once, and lanes keep a prefix on one worker."""
from __future__ import annotations

from argparse import Namespace
from collections import Counter

import pytest

from kvgate.bench.prefix import PrefixMix, make_prefix_jobs, ratios, run_contestant


def _args(**kw) -> Namespace:
    base = dict(workers=2, lanes=8, step_ms=2.0, per_token_ms=0.005, speed=1.0, seed=3, steal_age_ms=100, max_lag_ms=1000)
    return Namespace(**{**base, **kw})


def test_jobs_share_zipf_popular_prefixes_with_unique_suffixes():
    mix = PrefixMix(prefixes=8, prefix_tokens=64, suffix_tokens=(4, 8), max_tokens=(2, 4))
    jobs = make_prefix_jobs(400, mix, seed=0, clients=1)
    heads = Counter(tuple(j.prompt_token_ids[:64]) for j in jobs)
    counts = [n for _, n in heads.most_common()]
    assert len(heads) == 8 and counts[0] > 3 * counts[-1]  # popularity falls off
    assert len({tuple(j.prompt_token_ids) for j in jobs}) == 400
    assert all(68 <= len(j.prompt_token_ids) <= 72 and 2 <= j.sampling.max_tokens <= 4 for j in jobs)


@pytest.mark.parametrize("name", ["shared", "lanes", "ideal"])
def test_each_contestant_answers_every_job_once_and_counts_cached_prompt_tokens(shared_redis, name):
    mix = PrefixMix(prefixes=3, prefix_tokens=64, suffix_tokens=(4, 16), max_tokens=(2, 4))
    jobs = make_prefix_jobs(30, mix, seed=1, clients=1)
    out = run_contestant(shared_redis.url, name, "open-loop", jobs, 150.0, _args())  # paced: later jobs can hit
    assert out.answered_once and out.jobs == 30 and out.jobs_per_s > 0
    assert 0 < out.hit_rate < 1 and 0 < out.prefill_tokens < out.prompt_tokens
    if name != "lanes":
        assert out.steals == 0  # only lanes have owners to steal from


def test_a_saturation_run_reports_running_sequences_per_size_class_while_the_backlog_lasts(shared_redis):
    mix = PrefixMix(prefixes=3, prefix_tokens=64, suffix_tokens=(4, 16), max_tokens=(2, 4))
    jobs = make_prefix_jobs(300, mix, seed=2, clients=1)
    out = run_contestant(shared_redis.url, "shared", "saturation", jobs, None, _args(speed=0.1))
    assert out.answered_once and set(out.running) == {"small", "large"}
    assert out.running["large"] > out.running["small"] > 0  # 64 sequences against 8
    assert 0 < out.backlog_s < 60


def test_ratios_compare_lanes_with_the_shared_stream_and_the_ideal():
    from kvgate.bench.prefix import Outcome

    def o(name, phase, **kw):
        base = dict(jobs=1, rate=None, jobs_per_s=10.0, hit_rate=0.5, prompt_tokens=100, prefill_tokens=50,
                    p50_wait_s=0.1, p99_wait_s=1.0, steals=0, answered_once=True)
        return Outcome(name, phase, **{**base, **kw})

    by = {("shared", "open-loop"): o("shared", "open-loop", prefill_tokens=80),
          ("lanes", "open-loop"): o("lanes", "open-loop", hit_rate=0.45, prefill_tokens=20, p99_wait_s=1.1),
          ("ideal", "open-loop"): o("ideal", "open-loop"),
          ("shared", "saturation"): o("shared", "saturation"),
          ("lanes", "saturation"): o("lanes", "saturation", jobs_per_s=16.0)}
    assert ratios(by) == {"hit_rate_to_ideal": 0.9, "prefill_to_shared": 0.25, "p99_wait_to_shared": 1.1,
                          "saturation_to_shared": 1.6}
