"""The offline GPU check kept honest without a GPU: its plan (every check of the issue, within one 480-s budget, at
most 8 files back, GPU tests collected from their own files only), its run mechanics (preflight stops the run, a
killed step keeps its partial JSON), the checkout importable without an install, and the parts of each check that
do not need a GPU. `make gpu-rehearsal` runs every step for real on a CPU; this file keeps CI cheap."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvgate.bench import gpu_check_runner, gpu_checks
from kvgate.bench.engine import CONTESTANTS
from kvgate.bench.hf import cache_blocks
from tests.support import ROOT

PY = sys.executable


def test_plan_runs_every_check_within_480_s_and_returns_at_most_8_files(tmp_path):
    steps = gpu_check_runner.plan(tmp_path)
    assert [s.name for s in steps] == ["preflight", "pytest-kernels", "pytest-engine", "graphs", "parity",
                                       "w-gpu-qwen2.5", "w-gpu-others", "w-gpu-qwen2.5-hf", "kernels"]
    assert sum(s.limit_s for s in steps) <= gpu_check_runner.BUDGET_S <= 480
    files = gpu_check_runner.out_files(steps)
    assert len(files) == len(set(files)) <= gpu_check_runner.MAX_FILES_OUT <= 8
    assert sum(s.limit_s for s in gpu_check_runner.plan(tmp_path, rehearsal=True)) <= 480


def test_gpu_tests_are_collected_from_the_files_that_hold_them_only(tmp_path):
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"pytest\.mark\.gpu|pytestmark\s*=.*gpu", p.read_text())}
    planned = {f for files in gpu_check_runner.GPU_TEST_FILES.values() for f in files}
    assert planned == marked
    for step in gpu_check_runner.plan(tmp_path):
        if step.name.startswith("pytest-"):
            assert "tests" not in step.command and set(step.command) & planned
            assert ("-m", "gpu") in zip(step.command, step.command[1:])


def test_w_gpu_steps_cover_every_model_and_contestant_and_parse(tmp_path):
    covered = set()
    for step in gpu_check_runner.plan(tmp_path):
        if "w-gpu" not in step.command:
            continue
        args = vars(parse(step.command))
        covered |= {(m, c) for m in args["models"].split(",") for c in args["contestants"].split(",")}
        assert args["json"].parent == tmp_path
    assert {c for m, c in covered if m == gpu_checks.RANDOM_MODELS[0]} == set(CONTESTANTS)
    assert {m for m, _ in covered} == set(gpu_checks.RANDOM_MODELS)
    # kvgate's figures never share a step (a process, a limit) with an HF baseline
    for step in gpu_check_runner.plan(tmp_path):
        if "w-gpu" in step.command:
            kinds = {c.split("_")[0] for c in vars(parse(step.command))["contestants"].split(",")}
            assert len(kinds) == 1, step.name


def parse(command):
    import argparse

    parser = argparse.ArgumentParser()
    for flag in ("--check", "--work", "--models", "--contestants"):
        parser.add_argument(flag)
    parser.add_argument("--json", type=Path)
    return parser.parse_args(command[command.index("kvgate.bench.gpu_check_runner") + 1:])


def test_make_gpu_check_runs_the_module_whose_plan_calls_itself_back(tmp_path):
    """The runner's steps run it again (`--check`): the Makefile's target, the plan and the module agree on its name,
    so a rename that misses one fails here and not on a lent GPU."""
    (target,) = re.findall(r"^gpu-check:.*?-m (kvgate\.bench\.\w+)", (ROOT / "Makefile").read_text(), re.M | re.S)
    assert target == gpu_check_runner.__name__
    assert all(s.command[:3] == (PY, "-m", target) for s in gpu_check_runner.plan(tmp_path) if "--check" in s.command)


@pytest.mark.parametrize("module", gpu_checks.ENTRY_POINTS)
def test_every_entry_point_the_preflight_imports_exists(module):
    __import__(module)


def test_the_checkout_imports_its_layers_without_an_install():
    """The image runs the checkout with no build: with no site (no editable finder), kvgate.engine is engine/."""
    site = sysconfig.get_paths()["purelib"]
    code = ("import kvgate, kvgate.engine.config as c, kvgate.kernels.reference as k, kvgate.worker, kvgate.bench; "
            "print(c.__file__, k.__file__)")
    done = subprocess.run([PY, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": site})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(ROOT / "engine" / "config.py"), str(ROOT / "kernels" / "reference.py")]


def test_a_failed_preflight_stops_the_run_with_its_reason(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir(), work.mkdir()
    say = f"import json; open({str(work / 'preflight.json')!r}, 'w').write(json.dumps(dict(ok=False, reason='no GPU')))"
    steps = [gpu_check_runner.Step("preflight", (PY, "-c", say + "; raise SystemExit(1)"), 30),
             gpu_check_runner.Step("graphs", (PY, "-c", "pass"), 30, "graphs.json")]
    assert gpu_check_runner.Run(out, work, rehearsal=True).run(steps) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["steps"]) == ["preflight"]
    assert summary["steps"]["preflight"]["reason"] == "no GPU"
    assert "FATAL" in (out / "run.log").read_text()


def test_a_step_killed_at_its_limit_returns_its_partial_json_and_the_run_goes_on(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir(), work.mkdir()
    partial = (f"import json, time; open({str(work / 'graphs.json')!r}, 'w').write(json.dumps(dict(bfloat16=1))); "
               "time.sleep(60)")
    steps = [gpu_check_runner.Step("graphs", (PY, "-c", partial), 3, "graphs.json"),
             gpu_check_runner.Step("kernels", (PY, "-c", "print('table')"), 30)]
    assert gpu_check_runner.Run(out, work, rehearsal=True).run(steps) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"]["graphs"]["rc"] == "timeout" and summary["steps"]["kernels"]["rc"] == 0
    assert json.loads((out / "graphs.json").read_text()) == {"bfloat16": 1}
    with tarfile.open(out / "results.tgz") as tar:
        assert {"./graphs.log", "./kernels.log", "./graphs.json"} <= set(tar.getnames())
    assert len(list(out.iterdir())) <= gpu_check_runner.MAX_FILES_OUT


def test_steps_past_the_global_deadline_are_skipped_and_said_so(tmp_path):
    steps = [gpu_check_runner.Step("kernels", (PY, "-c", "raise SystemExit('never runs')"), 30)]
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir(), work.mkdir()
    assert gpu_check_runner.Run(out, work, rehearsal=True, budget_s=2).run(steps) == 1
    entry = json.loads((out / "summary.json").read_text())["steps"]["kernels"]
    assert entry["rc"] == "skipped" and "left of 2" in entry["reason"]


def test_the_engine_and_hf_read_one_set_of_random_weights():
    sc = gpu_checks.Scale("cpu", 1, 512, 1, (1, 1), (1, 1), 1, (1, 1), 1, "1MiB")
    source = gpu_checks.held_source("random:smollm2-135m", sc)
    first, second = dict(source.weights(torch.float32)), dict(source.weights(torch.float32))
    assert first.keys() == second.keys() and all(first[k] is second[k] for k in first)
    assert source.config.num_hidden_layers == 1 and first["model.embed_tokens.weight"].shape[0] == 512


def test_replay_probe_compares_replay_with_eager_on_the_same_inputs():
    from tests.engine.helpers import random_prompts, tiny_source

    source, _ = tiny_source("llama", seed=6)
    sc = gpu_checks.Scale("cpu", None, None, 5, (3, 20), (4, 3), 1, (1, 1), 1, "1MiB")
    engine = gpu_checks.engine_for(source, sc, "float32", 5, eager=False)
    probe = gpu_checks.ReplayProbe(engine.runner)
    gpu_checks.greedy_ids(engine, random_prompts(5, 3, 20, seed=6), [4, 6, 9, 12, 15])
    assert probe.steps > 0 and probe.same_argmax == probe.rows and probe.max_diff < 1e-5

    # a replay that hands rows to the wrong sequences (a padding or bucket fault) is caught
    engine = gpu_checks.engine_for(source, sc, "float32", 5, eager=False)
    graphs = engine.runner.graphs
    replay = graphs.run
    graphs.run = lambda batch: (lambda out: out._replace(hidden=out.hidden.roll(1, 0), logits=out.logits.roll(1, 0),
                                                        tokens=out.tokens.roll(1, 0)))(replay(batch))
    probe = gpu_checks.ReplayProbe(engine.runner)
    gpu_checks.greedy_ids(engine, random_prompts(5, 3, 20, seed=6), [4, 6, 9, 12, 15])
    assert probe.max_diff > gpu_checks.BF16_LOGPROB_TOLERANCE


def test_hf_cache_blocks_read_block_size_on_5_17_and_page_size_after():
    from transformers import ContinuousBatchingConfig

    assert cache_blocks(SimpleNamespace(block_size=256), 1000) == 4  # transformers 5.17: no page_size
    real = ContinuousBatchingConfig()
    per_block = getattr(real, "page_size", None) or real.block_size
    assert cache_blocks(real, 3 * per_block + 1) == 4


def test_kvgate_is_compared_with_hf_across_the_two_qwen_steps(tmp_path):
    def figures(**tok_s):
        return json.dumps({"models": {"random:qwen2.5-0.5b": {"contestants": {
            name: {"output_tok_s": value} for name, value in tok_s.items()}}}})
    (tmp_path / "w-gpu-qwen2.5.json").write_text(figures(kvgate_continuous=40000.0, kvgate_static=20000.0))
    assert gpu_check_runner.across_steps(tmp_path).startswith("not available")  # the HF step never finished
    (tmp_path / "w-gpu-qwen2.5-hf.json").write_text(figures(hf_static=4000.0, hf_generate_batch=16000.0))
    assert gpu_check_runner.across_steps(tmp_path) == {"kvgate_static": 2.0, "hf_static": 10.0,
                                                       "hf_generate_batch": 2.5}


def test_the_triton_cache_comes_back_as_metadata_and_cubins_only(tmp_path):
    cache, key = tmp_path / "cache", tmp_path / "cache" / "KEY"
    key.mkdir(parents=True)
    children = {}
    for name in ("k.json", "k.cubin", "k.ptx", "k.llir"):
        (key / name).write_text(name)
        children[name] = str(key / name)
    (key / "__grp__k.json").write_text(json.dumps({"child_paths": children}))
    gpu_check_runner.pack_triton_cache(cache, tmp_path / "triton-cache.tgz")
    with tarfile.open(tmp_path / "triton-cache.tgz") as tar:
        assert sorted(tar.getnames()) == ["KEY/__grp__k.json", "KEY/k.cubin", "KEY/k.json"]
        group = json.loads(tar.extractfile("KEY/__grp__k.json").read())
    assert group == {"child_paths": {"k.json": str(key / "k.json"), "k.cubin": str(key / "k.cubin")}}


def test_a_w_gpu_steps_findings_carry_each_round_and_the_bound(tmp_path):
    (tmp_path / "w-gpu-qwen2.5.json").write_text(json.dumps({"models": {"random:qwen2.5-0.5b": {
        "contestants": {"kvgate_continuous": {"output_tok_s": 40000.4, "rounds_tok_s": [39000.0, 41000.0, 40000.4]}},
        "bound_tok_s": 200000.0, "fraction_of_bound": 0.2, "binds": "bandwidth"}}}))
    step = next(s for s in gpu_check_runner.plan(tmp_path) if s.name == "w-gpu-qwen2.5")
    found = gpu_check_runner.step_findings(tmp_path, step)
    assert found["tok_s"] == {"random:qwen2.5-0.5b": {"kvgate_continuous": 40000}}
    assert found["rounds_tok_s"] == {"random:qwen2.5-0.5b": {"kvgate_continuous": [39000, 41000, 40000]}}
    assert found["bound"] == {"random:qwen2.5-0.5b": {"bound_tok_s": 200000.0, "fraction_of_bound": 0.2,
                                                      "binds": "bandwidth"}}


def test_the_checks_w_gpu_runs_one_round_within_limits_sized_for_one(tmp_path):
    """The check's W-GPU steps (60 s / 50 s of its 480 s) were sized for one round; three warm rounds are `kvgate bench
    engine --workload gpu`'s (issue 41), so a model the check runs is not killed at its limit with nothing kept."""
    from kvgate.bench import engine as bench
    from kvgate.bench.gpu_checks import CHECK_ROUNDS, check_w_gpu, scale

    assert bench.WORKLOADS["gpu"].rounds == 3 and CHECK_ROUNDS == 1
    report = check_w_gpu(tmp_path / "w.json", scale("cpu"), ["random:qwen2.5-0.5b"], ["kvgate_continuous"])
    assert report["settings"]["repeats"] == 1
    entry = report["models"]["random:qwen2.5-0.5b"]["contestants"]["kvgate_continuous"]
    assert len(entry["rounds_tok_s"]) == 1 and entry["output_tok_s"] > 0
