"""Warm rounds (issue 41): no Triton compile inside a timed round of `kvgate bench engine`. On the CPU the kernels run
in Triton's interpreter, which compiles nothing, so kvgate.bench.compiles counts the variants a compiled run would
build (Triton's specialisation key of each launch); the run happens in a process of its own, where TRITON_INTERPRET
is set before Triton is first imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import ROOT


SCRIPT = """
import json, sys
import torch
from kvgate.bench.triton_interpreter import squeeze_scalar_index
squeeze_scalar_index()
from kvgate.bench import compiles, engine as bench
from kvgate.commands.cli import main
from kvgate.kernels.rmsnorm import rms_norm

folder = sys.argv[1]
found = {}
# the counter: one variant per specialisation, counted once per process
x, w = torch.randn(3, 64), torch.ones(64)
for name, dtype in (("first", torch.float32), ("again", torch.float32), ("fp16", torch.float16)):
    watch = compiles.RoundWatch(torch.device("cpu"))
    rms_norm(x.to(dtype), w.to(dtype), 1e-6)
    rms_norm(x.to(dtype), w.to(dtype), 1e-6, x.to(dtype))
    found[name] = watch.stop()["triton_compiles"]
args = ["bench", "engine", "--workload", "gpu", "--device", "cpu", "--dtype", "float32", "--model", folder,
        "--num-requests", "3", "--max-prompt", "20", "--max-output", "3", "--max-num-seqs", "2", "--repeats", "2",
        "--contestants", "kvgate_continuous", "--json", folder + ".json"]
warm = bench.warm_up
for name, warm_up in (("cold", lambda llm, m: None), ("warm", warm)):
    compiles._seen.clear()  # a fresh process as far as the count goes
    bench.warm_up = warm_up
    assert main(args) == 0
    entry = json.load(open(folder + ".json"))["models"][folder]["contestants"]["kvgate_continuous"]
    found[name] = {k: entry[k] for k in ("rounds_triton_compiles", "compiles_counted_by",
                                         "rounds_allocator_growth_bytes")}
print("FOUND " + json.dumps(found))
"""


def test_a_second_round_compiles_nothing_and_the_warm_up_leaves_the_first_nothing_either(tiny_model):
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVGATE_KERNELS": "triton"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("FOUND "))[6:])
    # with and without a residual: two variants; the same launches again: none; another dtype: both again
    assert (found["first"], found["again"], found["fp16"]) == (2, 0, 2)
    # without the warm-up the first timed round compiles the engine's kernels (the count sees them) ...
    assert found["cold"]["compiles_counted_by"] == "specialisation keys (interpreter)"
    assert found["cold"]["rounds_triton_compiles"][0] > 0
    # ... and a second round never compiles anything; with it, neither does the first
    assert found["cold"]["rounds_triton_compiles"][1] == 0
    assert found["warm"]["rounds_triton_compiles"] == [0, 0]
    assert found["warm"]["rounds_allocator_growth_bytes"] == [0, 0]  # a CPU has no caching allocator to grow


def test_the_warm_up_fills_the_batch_as_the_round_does(tiny_model):
    """The prefill kernel's BLOCK_B follows the sequences in a mixed step (64, 128, 256): a warm-up of two-token
    requests would finish each before the next prompts come in and never meet the round's fullest mixed step."""
    import torch

    from kvgate.bench import engine as bench
    from kvgate.engine.loader import resolve_model

    workload = bench.Workload("W-GPU", (tiny_model,), "float32", 12, (20, 40), (10, 30), 12, False,
                              prefill_budget=64)
    source = resolve_model(tiny_model)
    m = bench.ModelRun(source, bench.make_requests(workload, source.config.vocab_size, 0), workload,
                       torch.device("cpu"))
    llm = bench.kvgate_llm(m, "continuous")
    seen: list[int] = []
    run = llm.engine.runner.run

    def counting(batch):
        if sum(n for _, n in batch) > len(batch):  # a prefill or mixed step
            seen.append(len(batch))
        return run(batch)
    llm.engine.runner.run = counting
    bench.warm_up(llm, m)
    warm, seen[:] = max(seen), []
    llm.generate([r.prompt_ids for r in m.requests], bench.greedy_params(m.requests), use_tqdm=False)
    assert warm == max(seen) == 12  # every request in one mixed step, in the warm-up as in the round
