"""kvgate.bench.cpu_linear runs end to end and reports every projection with a matching result."""
from __future__ import annotations

import json

import pytest

from kvgate.bench import cpu_linear as bench_cpu_linear
from kvgate.kernels.cpu_linear import onednn_linear_available


@pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")
def test_cpu_linear_bench_reports_each_layer_matching_f_linear(tmp_path, capsys):
    path = tmp_path / "gemm.json"
    assert bench_cpu_linear.main(["--rows", "1,3", "--repeats", "2", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert {(r["layer"], r["rows"]) for r in report["results"]} == {
        (layer, rows) for layer in bench_cpu_linear.SHAPES for rows in (1, 3)}
    assert all(r["blas_ms"] > 0 and r["onednn_ms"] > 0 and r["max_abs_diff"] < 1e-3 for r in report["results"])
    assert "lm_head" in capsys.readouterr().out
