"""`make gpu-profile` kept honest without a GPU: its plan (six stages within one 300-s budget, at most 8 files back),
the Makefile and the module agreeing, and the CPU rehearsal of every stage at toy sizes: each stage runs under its
limit, OUT holds what the run promises in the format it promises, and every figure only a GPU has is null with the
reason, never a number."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kvgate.bench import gpu_profile
from kvgate.bench.gpu_profile_stages import busy_us
from tests.support import ROOT

PY = sys.executable


def test_plan_runs_every_stage_within_300_s_and_returns_at_most_8_files(tmp_path):
    steps = gpu_profile.plan(tmp_path)
    assert [s.name for s in steps] == ["preflight", "w-gpu-warm", "torch-profile", "graph-floor", "split-sweep",
                                       "prefill-sdpa"]
    assert sum(s.limit_s for s in steps) <= gpu_profile.BUDGET_S <= 300
    files = gpu_profile.out_files(steps)
    assert len(files) == len(set(files)) <= gpu_profile.MAX_FILES_OUT <= 8
    assert all(s.command[:3] == (PY, "-m", gpu_profile.__name__) for s in steps)


def test_make_gpu_profile_runs_the_module_whose_plan_calls_itself_back():
    (target,) = re.findall(r"^gpu-profile:.*?-m (kvgate\.bench\.\w+)", (ROOT / "Makefile").read_text(), re.M | re.S)
    assert target == gpu_profile.__name__
    assert re.search(r"^gpu-profile-rehearsal:.*?KVGATE_DEVICE=cpu", (ROOT / "Makefile").read_text(), re.M | re.S)


def test_the_gpu_idle_share_counts_overlapping_kernels_once():
    assert busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17


@pytest.mark.slow
def test_the_cpu_rehearsal_runs_every_stage_within_its_limit_and_returns_its_files(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "KVGATE_DEVICE": "cpu", "KVGATE_GPU_CHECK_LIMIT_SCALE": "2",
           "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    done = subprocess.run([PY, "-m", "kvgate.bench.gpu_profile", str(out), "--work", str(work)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert done.returncode == 0, (out / "run.log").read_text()[-4000:]
    assert summary["device"] == "cpu (rehearsal)" and summary["seconds"] <= summary["budget_s"]
    for name, step in summary["steps"].items():
        assert step["rc"] == 0 and step["seconds"] <= step["limit_s"], name
    names = {p.name for p in out.iterdir()}
    assert names <= set(gpu_profile.out_files(gpu_profile.plan(work))) and len(names) <= 8
    assert {"run.log", "summary.json", "results.tgz", "preflight.json", "w-gpu-warm.json", "profile.json"} <= names

    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight["ok"] and preflight["cupti"]["device_kernels"] is None and preflight["cupti"]["reason"]
    warm = json.loads((out / "w-gpu-warm.json").read_text())
    assert warm["triton_compiles"] == 0 and warm["allocator_growth_bytes"] == 0 and warm["bound_tok_s"] > 0
    decode = warm["steps"]["decode"]
    assert decode["steps"] > 0 and decode["wall_ms"]["total"] > 0 and decode["gpu_ms"] is None
    profile = json.loads((out / "profile.json").read_text())
    assert set(profile) == {"torch_profile", "graph_floor", "split_sweep", "prefill_vs_sdpa"}
    torch_profile = profile["torch_profile"]
    assert torch_profile["ok"] and torch_profile["gpu_idle_share"] is None and torch_profile["reason"]
    assert torch_profile["top_host_ops"]
    assert [int(b) for b in profile["graph_floor"]["by_bucket"]] == [1, 2, 4]  # the rehearsal's max_num_seqs 4
    sweep = profile["split_sweep"]["layouts"]["tiny"]["splits"]
    assert set(sweep) == {"1", "2", "4", "8", "16", "32", "auto"} and profile["split_sweep"]["copy_gb_s"] is None
    anchor = profile["prefill_vs_sdpa"]["layouts"]["tiny"]
    assert anchor["kvgate_prefill"]["ms"] > 0 and anchor["sdpa_math"]["ms"] > 0
    assert summary["w_gpu_warm_triton_compiles"] == 0 and summary["decode_gpu_idle_share"] is None
