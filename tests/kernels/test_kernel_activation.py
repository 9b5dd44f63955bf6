"""SiLU-and-mul against reference.silu_and_mul."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_testing import DEVICE, assert_close
from kvgate.kernels import activation, reference


@pytest.mark.parametrize("inner", [8, 100])
def test_silu_and_mul_matches_reference_for_ragged_widths(inner):
    x = torch.randn(2, 3, 2 * inner, device=DEVICE) * 4
    assert_close(activation.silu_and_mul(x), reference.silu_and_mul(x))


def test_silu_and_mul_splits_wide_rows_across_programs(monkeypatch):
    monkeypatch.setattr(activation, "BLOCK", 16)  # 50 columns -> 4 column programs, the last one ragged
    x = torch.randn(3, 100, device=DEVICE)
    assert_close(activation.silu_and_mul(x), reference.silu_and_mul(x))
