"""`kvgate bench lora`, scaled down to a tiny model: the JSON has its shape, both modes produced exactly the tokens
each request asked for, and the adapters it writes are served (loaded into slots)."""
from __future__ import annotations

import json

from kvgate.commands.cli import main


def test_lora_bench_scaled_down_runs_base_and_adapters_in_one_run(tiny_model, tmp_path):
    out = tmp_path / "lora.json"
    assert main(["bench", "lora", "--model", tiny_model, "--num-requests", "6", "--max-prompt", "20",
                 "--max-output", "5", "--max-num-seqs", "4", "--adapters", "3", "--rank", "4", "--repeats", "2",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "W-LORA engine" and report["settings"]["adapters"] == 3
    for mode in ("base", "lora"):
        assert report[mode]["requests_with_wrong_length"] == 0, mode
        assert len(report[mode]["rounds_tok_s"]) == 2 and report[mode]["output_tok_s"] > 0, mode
    assert report["base"]["output_tokens"] == report["lora"]["output_tokens"]
    assert report["adapter_loads"] == 3 and report["ratio"] > 0 and report["target_ratio"] == 0.8
