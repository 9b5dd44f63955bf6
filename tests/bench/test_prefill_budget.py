"""`kvgate bench engine --prefill-budget-sweep`: kvgate continuous once per step budget, the budget reaching the
engine (a smaller one takes more prefill steps for the same prompts), each budget's figures and the best of them."""
from __future__ import annotations

import json

import pytest

from kvgate.commands.cli import main


def test_each_budget_runs_kvgate_continuous_with_that_step_budget(tiny_model, tmp_path):
    out = tmp_path / "sweep.json"
    assert main(["bench", "engine", "--model", tiny_model, "--num-requests", "4", "--max-prompt", "40",
                 "--max-output", "3", "--max-num-seqs", "4", "--prefill-budget-sweep", "16,256", "--json",
                 str(out)]) == 0
    sweep = json.loads(out.read_text())["prefill_budget_sweep"][tiny_model]
    assert {k for k in sweep if k != "best"} == {"16", "256"} and sweep["best"] in (16, 256)
    small, large = sweep["16"], sweep["256"]
    assert small["prefill_steps"] > large["prefill_steps"] >= 1  # the prompts (16..40 tokens) in 16-token chunks
    for entry in (small, large):
        assert entry["output_tok_s"] > 0 and len(entry["rounds_tok_s"]) == 1 and entry["prefill_step_ms"] > 0


@pytest.mark.parametrize("text", ["", "4096,x", "0,16"])
def test_a_sweep_that_names_no_budget_is_refused_with_what_to_pass(text):
    with pytest.raises(SystemExit, match="2048,4096,8192,16384|budgets >= 1"):
        from kvgate.bench.engine import budgets
        budgets(text)
