"""W-STRUCT (`kvgate bench structured`) at its smallest size on the CPU: one request on the bundled SmolLM2-135M,
unconstrained and constrained to the bench's schema (with and without jump-forward); every constrained answer is
counted, validates against the schema and ends with its JSON, and jump-forward saves steps."""
from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")


@pytest.mark.slow  # about 2 minutes on the shared 2-core machine: 128 unconstrained steps and two constrained runs
def test_kvgate_bench_structured_counts_every_constrained_answer_valid_at_its_smallest_size(tmp_path):
    from kvgate.bench.structured import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "wstruct.json"
    # max_tokens 128: room for the schema's whole object (about 80 tokens with SmolLM2's greedy choices)
    args = parser.parse_args(["--num-requests", "1", "--max-prompt", "16", "--max-output", "128", "--batch", "1",
                              "--host-batch", "2", "--device", "cpu", "--json", str(out)])
    assert run(args) == 0
    r = json.loads(out.read_text())
    assert r["workload"] == "W-STRUCT" and r["settings"]["num_requests"] == 1 and set(r["runs"]) == {"1"}
    figures = r["runs"]["1"]
    assert figures["unconstrained"]["output_tokens"] == 128  # ignore_eos: the whole budget
    assert "valid" not in figures["unconstrained"]
    for name in ("constrained", "constrained_no_jump_forward"):
        c = figures[name]
        assert c["answers"] == 1 and c["valid"] == 1 and c["finished_stop"] == 1, (name, c)
        assert 0 < c["output_tokens"] < 128 and c["masked_steps"] > 0 and c["mask_ms_per_step_median"] > 0
    # the same greedy answer either way; jump-forward appends forced tokens without a forward each
    assert figures["constrained"]["output_tokens"] == figures["constrained_no_jump_forward"]["output_tokens"]
    assert figures["constrained"]["steps"] < figures["constrained_no_jump_forward"]["steps"]
    assert 0 < figures["jump_forward_steps_saved"] < 1
    compiled = r["compile"]["llguidance"]
    assert compiled["compile_ms"] > 0 and 0 <= compiled["cached_ms"] < compiled["compile_ms"]
    assert r["host_mask"]["rows"] == 2 and r["host_mask"]["fill_ms"] > 0
