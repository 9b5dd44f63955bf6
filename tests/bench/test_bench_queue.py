"""`kvgate bench queue --simulated` runs W-QUEUE end to end through a real embedded redis-server (fast: the
SimulatedEngine) and writes the report the benchmark table reads; with --tracing, also the traced pass, whose spans
reach its local OTLP receiver."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_queue_writes_ratio_and_overhead_percentiles(tmp_path):
    out = tmp_path / "wq.json"
    proc = subprocess.run([sys.executable, "-m", "kvgate.commands.cli", "bench", "queue", "--simulated", "--num-requests", "8",
                           "--probes", "5", "--tracing", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["workload"] == "W-QUEUE" and report["queue"]["output_tokens"] == report["in_process"][0]["output_tokens"]
    assert 0.5 < report["throughput_ratio"] < 1.5
    assert 0 < report["overhead_ms"]["p50"] <= report["overhead_ms"]["p99"] < 1000
    assert report["versions"]["redis_server"] and report["machine"]["cores"]
    assert "machine" in proc.stdout and "throughput ratio" in proc.stdout
    traced = report["tracing"]
    assert traced["queue"]["output_tokens"] == report["queue"]["output_tokens"] and traced["ratio"] > 0
    assert traced["exports"] >= 1 and traced["export_bytes"] > 1000  # 13 jobs' spans, sent as OTLP protobuf
