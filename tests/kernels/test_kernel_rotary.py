"""Neox rotary against reference.rotary."""
from __future__ import annotations

import torch

from tests.kernels.kernel_testing import DEVICE, assert_close
from kvgate.kernels import reference
from kvgate.kernels.rotary import rotary


def cos_sin(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def test_rotary_rotates_q_and_k_heads_of_a_fused_projection_like_the_reference():
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    qkv = torch.randn(5, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    cos, sin = cos_sin(torch.tensor([0, 1, 2, 7, 100], device=DEVICE), head_dim)
    q_out, k_out = rotary(q, k, cos, sin)
    q_expected, k_expected = reference.rotary(q, k, cos, sin)
    assert_close(q_out, q_expected)
    assert_close(k_out, k_expected)


def test_rotary_leaves_position_zero_unchanged_and_handles_a_non_power_of_two_half():
    head_dim = 24
    q, k = torch.randn(2, 3, head_dim, device=DEVICE), torch.randn(2, 1, head_dim, device=DEVICE)
    cos, sin = cos_sin(torch.tensor([0, 5], device=DEVICE), head_dim)
    q_out, k_out = rotary(q, k, cos, sin)
    assert_close(q_out[0], q[0])
    assert_close(q_out, reference.rotary(q, k, cos, sin)[0])
    assert_close(k_out, reference.rotary(q, k, cos, sin)[1])
