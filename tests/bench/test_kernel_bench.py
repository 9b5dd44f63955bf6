"""kvgate.bench.kernels runs end to end (tiny shapes, interpreter) and reports every kernel with a correct result,
the decode rows with their split count and chunk."""
from __future__ import annotations

import json
import os
import re

import pytest

from tests.kernels.kernel_testing import HAS_CUDA
from kvgate.bench import kernels as bench


@pytest.mark.skipif(HAS_CUDA, reason="--tiny runs in the CPU interpreter; on a GPU run `python -m kvgate.bench.kernels`")
def test_tiny_bench_reports_each_kernel_matching_its_reference(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--tiny", "--models", "qwen2.5-0.5b", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    kernels = {r["kernel"] for r in report["results"]}
    assert kernels == {"store_kvcache", "decode_attention", "prefill_attention", "rms_norm+residual", "rotary",
                       "qkv_rope_store", "silu_and_mul"}
    assert report["interpreter"] and report["copy_gbps"] > 0
    assert all(r["max_abs_diff"] < 1e-4 and r["triton_ms"] > 0 for r in report["results"])
    decode = [r for r in report["results"] if r["kernel"] == "decode_attention"]
    assert all(re.fullmatch(r"\d+x\d+", r["launch"]) for r in decode)  # split count x chunk, as issue 41 tunes them
    printed = capsys.readouterr().out
    assert all(r["launch"] in printed for r in decode)


@pytest.mark.skipif(HAS_CUDA, reason="--tiny runs in the CPU interpreter; on a GPU run `python -m kvgate.bench.decode_kernels`")
def test_tiny_decode_kernels_lists_each_models_launches_per_decode_layer(tmp_path, capsys, monkeypatch):
    from kvgate.bench import decode_kernels

    monkeypatch.delenv("KVGATE_KERNELS", raising=False)
    path = tmp_path / "launches.json"
    assert decode_kernels.main(["--tiny", "--models", "qwen3-0.6b", "--json", str(path)]) == 0
    report = json.loads(path.read_text())["qwen3-0.6b"]
    assert report["kernels"] == len(report["launches"]) == 9 and report["syncs"] == 0
    assert report["by_name"]["triton._qkv_rope_store_kernel"] == 1
    assert "qwen3-0.6b: 9 kernels per decode layer" in capsys.readouterr().out
    assert "KVGATE_KERNELS" not in os.environ  # forced for the listing only: later tests take the CPU default
