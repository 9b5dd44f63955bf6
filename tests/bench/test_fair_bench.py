"""W-FAIR (`kvgate bench fair`) at a tiny scale: both contestants, every phase measured, every job answered once, the
fair reader keeping B's and C's wait beside A's flood below FIFO's; on a 3-primary cluster with affinity lanes on too;
and fair-share jobs enqueued in their own shard's band, as the SDK puts them."""
from __future__ import annotations

import argparse
import json

import pytest

from kvgate.bench import fleet_sim
from kvgate.bench.fair import (add_arguments, alone_order, check_contestants, run, shard_tails, spread_of,
                               wait_answered, wait_first_answer, window_shares)
from kvgate.bench.fleet_cluster import cluster_unavailable
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import FIELD, decode_job

# 4 workers, 5 ms steps: A's backlog 200 jobs, B and C 50 each, share backlogs 100 a tenant, 0.5 s windows (~70 s
# here; 100 jobs a tenant drain in 2-3 s, and the first window is not counted)
TINY = ["--scale", "0.01", "--workers", "4", "--cost-jobs", "1000", "--window-s", "0.5", "--step-ms", "5"]


def _bench(tmp_path, *flags: str) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "wfair.json"
    assert run(parser.parse_args([*TINY, *flags, "--json", str(out)])) == 0
    return json.loads(out.read_text())


def _every_phase_measured(r: dict) -> None:
    assert set(r["runs"]) == {"fifo", "fair"} and set(r["cost"]) == {"fifo", "fair"}
    for name, c in r["runs"].items():
        assert c["contestant"] == name and c["answered_once"] is True
        assert c["a_alone_jobs_per_s"] > 0 and c["bc_rate_jobs_per_s"] > 0
        passes = c["a_alone_passes_jobs_per_s"]  # two rounds by default: fifo, fair, fair, fifo
        assert len(passes) == 2 and all(p > 0 for p in passes), passes
        assert c["a_alone_jobs_per_s"] == pytest.approx(sum(passes) / 2, abs=0.06)
        assert c["flood_bc_start_s"] > 0  # B and C start once A's flood has a job answered
        for phase in ("alone_p99_wait_s", "flood_p99_wait_s", "flood_wait_ratio"):
            assert set(c[phase]) == {"b", "c"} and all(v > 0 for v in c[phase].values()), (name, phase, c[phase])
        for label in ("equal", "weighted_2_1_1"):
            shares = c[label]["shares"]
            assert c[label]["windows"] == len(shares)
            assert all(set(s) == {"a", "b", "c"} and abs(sum(s.values()) - 1) < 1e-3 for s in shares)
    for name, cost in r["cost"].items():
        assert cost["answered_once"] is True and cost["jobs"] == 1000 and cost["jobs_per_s"] > 0
        assert cost["redis_cpu_s"] > 0
    assert r["a_alone_ratio_to_fifo"] > 0 and r["redis_cpu_per_job_ratio_to_fifo"] > 0


def test_kvgate_bench_fair_answers_every_job_once_and_the_fair_reader_keeps_b_and_c_ahead_of_the_flood(tmp_path):
    r = _bench(tmp_path)
    assert r["workload"] == "W-FAIR" and r["answered_once"] is True
    assert r["variant"] == {"redis": "one Redis", "cluster_primaries": 0, "affinity": "off", "lanes": 0}
    _every_phase_measured(r)
    fifo, fair = r["runs"]["fifo"], r["runs"]["fair"]
    assert fifo["shards"] == fair["shards"] == 1 and fifo["lanes"] == fair["lanes"] == 0
    # FIFO serves A's whole backlog first; the fair reader gives B and C the next free slot
    for t in ("b", "c"):
        assert fair["flood_p99_wait_s"][t] < fifo["flood_p99_wait_s"][t], (fair["flood_p99_wait_s"],
                                                                           fifo["flood_p99_wait_s"])
    # the fair reader serves all three tenants side by side while they are backlogged: windows to measure
    assert fair["equal"]["windows"] >= 1 and fair["weighted_2_1_1"]["windows"] >= 1


def test_an_unknown_contestant_is_refused_by_name_before_anything_runs():
    with pytest.raises(SystemExit, match="unknown fair-turns; choose from fifo, fair, fair-wait, fair-hashed"):
        check_contestants("fifo,fair-turns")
    with pytest.raises(SystemExit, match="none given"):
        check_contestants(" , ")
    assert check_contestants("fifo, fair-hashed") == ["fifo", "fair-hashed"]


def test_a_tenants_shard_tail_is_from_its_first_shard_running_dry_to_its_last_admission():
    from types import SimpleNamespace

    keys = Keys("t", shards=2, cluster=True)
    ids = {k: [f"j{i}" for i in range(40) if keys.shard_of(f"j{i}") == k][:2] for k in (0, 1)}
    admitted = {ids[0][0]: 10.0, ids[0][1]: 12.5, ids[1][0]: 11.0, ids[1][1]: 19.0}
    finals = {i: [SimpleNamespace(timings=SimpleNamespace(admitted=at))] for i, at in admitted.items()}
    jobs = [SimpleNamespace(job_id=i) for i in admitted]
    # shard 0 ran dry at 12.5 s, shard 1 at 19.0 s; a job never admitted (nor answered) counts nowhere
    assert shard_tails(finals, {"a": jobs + [SimpleNamespace(job_id="lost")], "b": jobs[:1]}, keys) == {"a": 6.5,
                                                                                                     "b": 0.0}


def test_share_windows_start_once_every_tenant_has_jobs_queued_not_at_the_first_tenants_first_job():
    """W-FAIR on a cluster enqueues A's 6,000 jobs (2:1:1) before B's and C's, 10-20 s through the SDK's dealing:
    until C's first job lands, A and B rightly share the fleet, and a window that counted those seconds read C's
    lateness as unfairness (BENCHMARKS.md, W-FAIR, 2026-12-04 06:51: A 0.61, C 0.07)."""
    from types import SimpleNamespace

    def job(tenant: str, i: int, queued: float, admitted: float):
        usage = SimpleNamespace(prompt_tokens=6, completion_tokens=4)
        return SimpleNamespace(job_id=f"{tenant}{i}"), [SimpleNamespace(
            timings=SimpleNamespace(queued=queued, admitted=admitted), usage=usage)]

    by, finals = {}, {}
    for tenant, joins in (("a", 0.0), ("b", 1.0), ("c", 12.0)):  # one job a second each from when it joins
        made = [job(tenant, i, joins, joins + i) for i in range(int(41 - joins))]
        by[tenant] = [j for j, _ in made]
        finals.update({j.job_id: f for j, f in made})
    shares = window_shares(finals, by, 10.0)
    assert shares == [{"a": 0.3333, "b": 0.3333, "c": 0.3333}] * 2  # [12, 22) and [22, 32); [32, 42) ends past 40


def test_a_long_phase_says_how_far_it_has_come_and_a_stuck_one_names_itself(monkeypatch, capsys):
    answered = iter([0, 1, 2, 3])
    monkeypatch.setattr(fleet_sim, "count_results", lambda client, keys, jobs: next(answered))
    wait_answered(None, Keys("t"), [1, 2, 3], 60, "fair: A alone", every_s=0)
    err = capsys.readouterr().err
    assert "fair: A alone: 1 of 3 jobs answered after" in err and "2 of 3" in err and "3 of 3" not in err

    monkeypatch.setattr(fleet_sim, "count_results", lambda client, keys, jobs: 1)
    with pytest.raises(TimeoutError, match="fifo: A's flood: only 1 of 3 jobs answered in 0 s"):
        wait_answered(None, Keys("t"), [1, 2, 3], 0, "fifo: A's flood")


def test_b_and_c_join_the_flood_once_one_of_its_jobs_is_answered_past_the_fleets_first_fill(redis_server):
    """An idle fleet's first fill of a flood runs long prefill steps that any job landing then waits out; B and C
    join the flood's steady state: the wait returns at the first answer in any of A's clients' reply streams, and
    a flood that nobody answers fails by name."""
    import redis

    client, keys = redis.Redis.from_url(redis_server.url), Keys("wfair-t")
    a = fleet_sim.make_jobs(4, fleet_sim.JobMix(), seed=0, clients=2)
    with pytest.raises(TimeoutError, match="fair: A's flood's first answer: none of 4 jobs answered in 0 s"):
        wait_first_answer(client, keys, a, 0, "fair: A's flood's first answer")
    client.xadd(keys.replies(a[1].client_id)[0], {FIELD: b"final"})
    wait_first_answer(client, keys, a, 5, "fair: A's flood's first answer")


def test_a_alone_passes_take_turns_each_round_reversed_so_load_drift_weighs_on_every_contestant_alike():
    assert alone_order(["fifo", "fair"], 2) == ["fifo", "fair", "fair", "fifo"]
    assert alone_order(["fifo", "fair", "fair-wait"], 3) == ["fifo", "fair", "fair-wait", "fair-wait", "fair", "fifo",
                                                             "fifo", "fair", "fair-wait"]
    assert alone_order(["fair"], 1) == ["fair"]


@pytest.mark.slow
def test_kvgate_bench_fair_on_a_three_primary_cluster_with_affinity_lanes_answers_every_job_once(tmp_path):
    if why := cluster_unavailable():
        pytest.skip(why)
    r = _bench(tmp_path, "--cluster-primaries", "3", "--affinity", "on", "--lanes", "8")
    assert r["answered_once"] is True
    assert r["variant"] == {"redis": "cluster of 3 primaries", "cluster_primaries": 3, "affinity": "on", "lanes": 8}
    _every_phase_measured(r)
    for c in r["runs"].values():
        assert c["shards"] == 6 and c["lanes"] == 8  # two shards a primary; the workers set the namespace's lanes
    assert r["runs"]["fair"]["equal"]["windows"] >= 1 and r["runs"]["fair"]["weighted_2_1_1"]["windows"] >= 1
    for label in ("equal", "weighted_2_1_1"):
        tails = r["runs"]["fair"][label]["shard_tail_s"]
        assert set(tails) == {"a", "b", "c"} and all(t >= 0 for t in tails.values()), tails


@pytest.mark.parametrize("dealt", [False, True], ids=["hashed", "dealt"])
def test_fair_share_jobs_go_to_their_tenants_stream_in_their_own_shards_band_on_a_cluster(tmp_path, dealt):
    """Each job in its tenant's stream of the band of the shard its id hashes to; dealt out as the SDK deals them
    (the fair contestant), every tenant's jobs weigh the same in every shard to within one job."""
    if why := cluster_unavailable():
        pytest.skip(why)
    from kvgate.producer.quotas import estimate_tokens
    from kvgate.producer.redis_url import connect, keys_for
    from kvgate.redis_cluster import ClusterGroup

    group = ClusterGroup(tmp_path, primaries=3, replicas=0, extra_args=("--appendonly", "no")).start()
    try:
        client = connect(group.url)
        keys = keys_for(group.url, client, "fairplace")
        jobs = fleet_sim.make_jobs(60, fleet_sim.JobMix(max_tokens=(2, 2)), seed=0, clients=1)
        for i, job in enumerate(jobs):
            job.job_id, job.tenant = f"place-{i}", "ab"[i % 2]
        fleet_sim.enqueue(client, keys, jobs, rate=None, batch=25, fair=True, spread=spread_of(keys, dealt))
        if dealt:
            for tenant in "ab":
                weights = [sum(estimate_tokens(j) for j in jobs if j.tenant == tenant and keys.shard_of(j.job_id) == k)
                           for k in range(len(keys.parts))]
                assert max(weights) - min(weights) <= max(estimate_tokens(j) for j in jobs), (tenant, weights)
        bands = {keys.jobs(None, "normal", shard=k) for k in range(len(keys.parts))}
        placed = {}
        for band in bands:
            for tenant in "ab":
                for _, fields in client.xrange(Keys.tenant_jobs(band, tenant)):
                    placed[decode_job(fields[FIELD.encode()]).job_id] = (band, tenant)
        assert len(keys.parts) == 6 and len(placed) == 60
        for job in jobs:
            assert placed[job.job_id] == (keys.jobs(None, "normal", shard=keys.shard_of(job.job_id)), job.tenant)
        used = {band for band, _ in placed.values()}
        assert len(used) > 1  # 60 ids spread over the shards
        for band in used:
            queued = sum(1 for b, _ in placed.values() if b == band)
            assert int(client.get(Keys.fair_queued(band))) == queued
            assert {t.decode() for t in client.zrange(Keys.fair_backlog(band), 0, -1)} == \
                {t for b, t in placed.values() if b == band}
    finally:
        group.stop()
