"""`kvgate bench lora --fleet` (W-LORA's fleet half), at a tiny scale: the report has its shape, every arm of both
phases ran the same jobs and answered each exactly once, and only the arms with adapters loaded any."""
from __future__ import annotations

import json
from collections import Counter

from kvgate.bench.lora_fleet import ARMS, DECILES, PHASES, TARGETS, LoraMix, make_lora_jobs, verdicts
from kvgate.commands.cli import main


def test_the_fleet_half_runs_three_arms_on_the_same_jobs_each_answering_every_job_once(tmp_path):
    out = tmp_path / "wlora.json"
    assert main(["bench", "lora", "--fleet", "--workers", "2", "--slots", "2", "--adapters", "10", "--jobs", "40",
                 "--seconds", "1", "--max-num-seqs", "4", "--max-prompt", "48", "--max-output", "4",
                 "--step-ms", "2", "--per-token-ms", "0.01", "--lora-load-ms", "5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "W-LORA fleet" and report["answered_once"]
    runs = {(r["arm"], r["phase"]): r for r in report["runs"]}
    assert set(runs) == {(arm, phase) for arm in ARMS for phase in PHASES} and len(report["runs"]) == 6
    for phase in PHASES:
        jobs = {runs[(arm, phase)]["jobs"] for arm in ARMS}
        assert len(jobs) == 1, f"{phase}: the arms ran different jobs: {jobs}"
    assert runs[("aware", "saturation")]["jobs"] == 40
    for (arm, phase), r in runs.items():
        assert r["answered_once"], (arm, phase)
        assert len(r["deciles"]) == DECILES and sum(d["jobs"] for d in r["deciles"]) == r["jobs"], (arm, phase)
        assert r["jobs_per_s"] > 0 and (r["loads"] == 0) == (arm == "base"), (arm, phase)
        assert r["fleet_start_s"] > 0, (arm, phase)  # each fleet served before its first job: its start not timed
    assert set(report["verdicts"]) == {"loads_to_blind", "jobs_per_s_to_base", "cold_to_hot_p99_wait"}
    assert set(report["verdicts"].values()) <= {"PASS", "FAIL"} and report["targets"] == TARGETS
    assert set(report["ratios"]["loads_to_blind"]) == set(PHASES)


def test_jobs_name_adapters_by_zipf_popularity_and_deciles_split_the_adapters_by_rank():
    mix = LoraMix(adapters=20)
    jobs = make_lora_jobs(2000, mix, seed=0, clients=1)
    counts = Counter(j.model for j in jobs)
    assert counts["adapter-000"] > 5 * counts["adapter-019"] > 0 and set(counts) <= set(mix.names())
    decile_of = mix.decile_of()
    assert decile_of["adapter-000"] == decile_of["adapter-001"] == 0 and decile_of["adapter-019"] == DECILES - 1


def test_a_target_is_a_pass_only_where_its_figure_was_taken_and_met():
    got = {"loads_to_blind": {"saturation": 0.2, "open-loop": 0.5}, "jobs_per_s_to_base": 0.89,
           "cold_to_hot_p99_wait": {"saturation": 9.0, "open-loop": 3.0}}
    assert verdicts(got) == {"loads_to_blind": "PASS", "jobs_per_s_to_base": "FAIL", "cold_to_hot_p99_wait": "PASS"}
    got |= {"loads_to_blind": {"saturation": 0.2, "open-loop": None}, "cold_to_hot_p99_wait": {"open-loop": None}}
    assert verdicts(got) == {"loads_to_blind": "FAIL", "jobs_per_s_to_base": "FAIL", "cold_to_hot_p99_wait": "FAIL"}
