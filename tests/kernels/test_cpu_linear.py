"""The oneDNN-packed CPU GEMM computes what F.linear does, for any number of rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvgate.kernels import cpu_linear
from kvgate.kernels.cpu_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_linear_available(), reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("rows", [1, 5, 32, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear_whatever_the_row_count(rows, with_bias):
    torch.manual_seed(rows)
    weight, x = torch.randn(96, 40), torch.randn(rows, 40)
    bias = torch.randn(96) if with_bias else None
    got = PackedLinear(weight, bias, rows_hint=32)(x)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_pack_linears_replaces_float32_cpu_layers_only():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)),
                          nn.Linear(4, 4).to(torch.float64))
    x = torch.randn(3, 8)
    expected = model[:3](x)
    assert pack_linears(model, rows_hint=4) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert type(model[3]) is nn.Linear and not can_pack(model[3].weight)  # float64 keeps the BLAS path
    torch.testing.assert_close(model[:3](x), expected, rtol=1e-5, atol=1e-5)


def test_a_torch_build_without_the_onednn_ops_keeps_f_linear(monkeypatch):
    monkeypatch.setattr(cpu_linear, "onednn_linear_available", lambda: False)
    model = nn.Sequential(nn.Linear(8, 16))
    assert pack_linears(model, rows_hint=4) == 0 and type(model[0]) is nn.Linear
