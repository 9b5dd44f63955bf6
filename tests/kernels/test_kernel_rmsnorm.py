"""Fused RMSNorm (+ residual) against reference.rms_norm."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, assert_close
from kvgate.kernels import reference
from kvgate.kernels.rmsnorm import rms_norm


@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm_matches_reference_without_residual(hidden):
    x, weight = torch.randn(5, hidden, device=DEVICE), torch.randn(hidden, device=DEVICE)
    out, residual = rms_norm(x, weight, 1e-6)
    expected, _ = reference.rms_norm(x, weight, 1e-6)
    assert residual is None
    assert_close(out, expected)


def test_rms_norm_adds_the_residual_first_and_returns_the_sum_as_the_new_residual():
    x, r, weight = (torch.randn(2, 3, 96, device=DEVICE), torch.randn(2, 3, 96, device=DEVICE),
                    torch.randn(96, device=DEVICE))
    out, residual = rms_norm(x, weight, 1e-5, r)
    expected, expected_residual = reference.rms_norm(x, weight, 1e-5, r)
    assert out.shape == x.shape
    assert_close(residual, expected_residual)
    assert_close(out, expected)


def test_rms_norm_over_head_dim_of_a_strided_qk_view():
    qkv = torch.randn(4, 6, 32, device=DEVICE)  # q/k norm (Qwen3) normalises heads of a fused projection
    weight = torch.randn(32, device=DEVICE)
    out, _ = rms_norm(qkv[:, :4], weight, 1e-6)
    assert_close(out, reference.rms_norm(qkv[:, :4], weight, 1e-6)[0])


def test_rms_norm_in_half_precision_rounds_like_the_reference():
    x, r = torch.randn(3, 64, device=DEVICE).half(), torch.randn(3, 64, device=DEVICE).half()
    weight = torch.randn(64, device=DEVICE).half()
    out, residual = rms_norm(x, weight, 1e-6, r)
    expected, expected_residual = reference.rms_norm(x, weight, 1e-6, r)
    assert torch.equal(residual, expected_residual)
    assert_close(out, expected, atol=2e-3, rtol=2e-3)
