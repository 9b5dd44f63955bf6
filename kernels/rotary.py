"""Neox-style rotary embedding of q and k in one launch, one token per program (twin: reference.rotary)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgate.kernels.config import elementwise_warps


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_n, stride_h, stride_on, stride_oh, num_heads, cos, sin, half,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    src = x_ptr + token * stride_n + heads * stride_h + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    dst = out_ptr + token * stride_on + heads * stride_oh + dims
    tl.store(dst, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(dst + half, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                   stride_qn, stride_qh, stride_kn, stride_kh, stride_qon, stride_qoh, stride_kon, stride_koh,
                   stride_cos, stride_sin, num_heads, num_kv_heads, half,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=dims < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=dims < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qn, stride_qh, stride_qon, stride_qoh, num_heads, cos, sin, half,
                  BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kn, stride_kh, stride_kon, stride_koh, num_kv_heads, cos, sin,
                  half, BLOCK_HK, BLOCK_HALF)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0), sin.stride(0),
        num_heads, num_kv_heads, half,
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half, num_warps=elementwise_warps(triton.next_power_of_2(num_heads) * block_half),
    )
    return q_out, k_out
