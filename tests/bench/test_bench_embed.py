"""`kvgate bench embed --simulated` runs W-EMBED end to end through a real embedded redis-server (fast: the
SimulatedEngine) and writes the figures the benchmark table reads."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_embed_writes_embeddings_per_second_and_the_generation_cost(tmp_path):
    out = tmp_path / "we.json"
    proc = subprocess.run([sys.executable, "-m", "kvgate.commands.cli", "bench", "embed", "--simulated",
                           "--num-requests", "8", "--num-generate", "2", "--max-output", "8", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["workload"] == "W-EMBED"
    counts = [report["in_process"], report["queue"], report["mixed"]["embed"]]
    assert [c["embeddings"] for c in counts] == [8, 8, 8]
    assert report["queue"]["embeddings_s"] > 0 and report["queue_ratio"] > 0
    assert report["generate_alone"]["output_tokens"] == report["mixed"]["generate"]["output_tokens"] > 0
    assert report["generation_cost"] < 1 and report["versions"]["redis_server"]
    assert "generation throughput lost" in proc.stdout
