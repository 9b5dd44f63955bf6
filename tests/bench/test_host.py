"""`kvgate bench host` scaled down: each case measured on this tree's engine and on a baseline commit's engine
(extracted with git archive, measured in its own subprocess), with the parts adding up to the host time."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvgate.bench import host

ROOT = Path(host.__file__).resolve().parents[2]


def test_host_bench_measures_baseline_and_current_engines_side_by_side(tmp_path):
    parser = argparse.ArgumentParser()
    host.add_arguments(parser)
    out = tmp_path / "host.json"
    args = parser.parse_args(["--baseline-ref", "HEAD", "--batches", "4", "--num-requests", "6", "--max-output", "12",
                              "--json", str(out)])
    assert host.run(args) == 0
    report = json.loads(out.read_text())
    # 2 temperatures x (no detok, inline detok, detok thread) + overlap off and on + gpu-shaped
    assert report["workload"] == "W-HOST" and len(report["cases"]) == 9
    for entry in report["cases"]:
        base, cur = entry["baseline"], entry["current"]
        assert cur["engine"] == str(ROOT / "engine")  # the editable install: this tree
        assert base["engine"] != cur["engine"] and base["engine"].endswith("kvgate/engine")
        for r in (base, cur):
            ms = r["full_decode_ms"]
            if entry["case"]["stub"]:
                assert r["host_s_all_steps"] > 0
                continue
            assert r["full_decode_steps"] > 0
            assert abs(sum(ms[p] for p in host.PARTS) - ms["host"]) < 1e-6
            assert all(ms[p] >= 0 for p in ("schedule", "prepare", "sampler"))
            threaded = entry["case"].get("detok") == "thread"
            assert (r["detok_thread_ms_per_step"] > 0) if threaded else r["detok_thread_ms_per_step"] is None
    overlap = {e["case"]["overlap"]: e["current"] for e in report["cases"] if e["case"].get("overlap")}
    assert overlap["off"]["overlapped_steps"] == 0 and overlap["off"]["device_gaps_ahead"] == 0
    assert overlap["on"]["overlapped_steps"] > 0 and overlap["on"]["device_gaps_ahead"] > 0
    assert overlap["on"]["exposed_host_ms_ahead"] is not None and overlap["off"]["exposed_host_ms"] > 0


def test_host_bench_rounds_report_medians_and_each_rounds_temperature_ratio(tmp_path):
    parser = argparse.ArgumentParser()
    host.add_arguments(parser)
    out = tmp_path / "host.json"
    args = parser.parse_args(["--batches", "4", "--num-requests", "6", "--max-output", "12", "--detok", "none",
                              "--no-gpu-shaped", "--no-overlap", "--rounds", "3", "--json", str(out)])
    assert host.run(args) == 0
    report = json.loads(out.read_text())
    assert [e["case"]["name"] for e in report["cases"]] == ["b4 greedy", "b4 t0.6"]
    for entry in report["cases"]:
        times = entry["current"]["rounds_host_ms"]
        assert len(times) == 3 and entry["current"]["full_decode_ms"]["host"] == sorted(times)[1]
    per_round = report["temperature_to_greedy"]["current"]["b4 t0.6"]
    assert len(per_round["rounds"]) == 3 and per_round["median"] == sorted(per_round["rounds"])[1]
    greedy, hot = (e["current"]["rounds_host_ms"] for e in report["cases"])
    assert sorted(per_round["rounds"]) == sorted(round(t / g, 2) for t, g in zip(hot, greedy))
