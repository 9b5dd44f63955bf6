"""`kvgate bench durability`, scaled down: both modes timed for submits and finishes, on a real primary and replica."""
from __future__ import annotations

import json

from kvgate.commands.cli import main


def test_the_durability_bench_times_submit_and_finish_in_both_modes(tmp_path):
    out = tmp_path / "wdur.json"
    assert main(["bench", "durability", "--jobs", "5", "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for cell in ("submit_primary", "submit_replicated", "finish_primary", "finish_replicated"):
        assert report[cell]["n"] == 5 and 0 < report[cell]["p50_ms"] <= report[cell]["p99_ms"], cell


def test_the_durability_bench_runs_on_a_redis_cluster(tmp_path):
    import pytest

    from kvgate.bench.fleet_cluster import cluster_unavailable

    if why := cluster_unavailable():
        pytest.skip(why)
    out = tmp_path / "wdur.json"
    assert main(["bench", "durability", "--cluster", "--jobs", "5", "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["cluster"] and report["finish_replicated"]["n"] == 5 and report["submit_replicated"]["n"] == 5
