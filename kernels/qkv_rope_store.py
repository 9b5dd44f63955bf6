"""The attention's small steps in one launch (twin: reference.qkv_rope_store): from the fused qkv projection's
output, q/k RMSNorm over the head dim (Qwen3; optional), neox rotary on q and k, and the store of k and v into
the paged cache at each token's slot (-1 skips the store, q is still written). One program per token.

Replaces, per layer and step: a copy of the strided q and k views plus a norm each (Qwen3), the rotary kernel
and the store kernel (6 launches for Qwen3, 2 for Llama/Qwen2, 1 here). Rounding follows the twin step by step:
the normed head is rounded to the input dtype before its weight is applied and again before the rotation."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgate.kernels.config import elementwise_warps


@triton.jit
def _norm_rotate(x_ptr, weight_ptr, num_heads, head_dim, half, eps, cos, sin,
                 HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Heads [BLOCK_H, 2 x BLOCK_HALF] at x_ptr (head h at h * head_dim), normed and rotated, as two fp32 halves."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    src = x_ptr + heads * head_dim + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)) / head_dim + eps)[:, None]
        w1 = tl.load(weight_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)
        x1f = ((x1f * inv).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        x2f = ((x2f * inv).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype).to(tl.float32)
    return x1f * cos - x2f * sin, x2f * cos + x1f * sin, heads, dims, mask


@triton.jit
def _qkv_rope_store_kernel(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                           slot_mapping_ptr, stride_qkv, stride_cos, stride_sin, stride_qon, stride_qoh,
                           cache_stride_b, cache_stride_t, cache_stride_h, num_heads, num_kv_heads, head_dim, eps,
                           HAS_NORM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_HQ: tl.constexpr,
                           BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    half = head_dim // 2
    row = qkv_ptr + token * stride_qkv
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=dims < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=dims < half, other=0.0).to(tl.float32)
    q1, q2, heads, dims, mask = _norm_rotate(row, q_norm_ptr, num_heads, head_dim, half, eps, cos, sin,
                                             HAS_NORM, BLOCK_HQ, BLOCK_HALF)
    dst = q_out_ptr + token * stride_qon + heads * stride_qoh + dims
    tl.store(dst, q1.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, q2.to(q_out_ptr.dtype.element_ty), mask=mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: a padding token (e.g. a CUDA-graph slot with no sequence) stores nothing
        k_row = row + num_heads * head_dim
        # new names: a compiled `if` may not give a variable from before it another shape (kv heads != q heads)
        k1, k2, kv_heads, kv_dims, kv_mask = _norm_rotate(k_row, k_norm_ptr, num_kv_heads, head_dim, half, eps, cos,
                                                          sin, HAS_NORM, BLOCK_HK, BLOCK_HALF)
        # k is rounded to the projection's dtype (as the twin's rotary returns it), then to the cache's
        k1, k2 = k1.to(qkv_ptr.dtype.element_ty), k2.to(qkv_ptr.dtype.element_ty)
        cached = ((slot // PAGE_SIZE) * cache_stride_b + (slot % PAGE_SIZE) * cache_stride_t
                  + kv_heads * cache_stride_h + kv_dims)
        tl.store(k_cache_ptr + cached, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_cache_ptr + cached + half, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        v_src = k_row + num_kv_heads * head_dim + kv_heads * head_dim + kv_dims
        v1 = tl.load(v_src, mask=kv_mask, other=0.0)
        v2 = tl.load(v_src + half, mask=kv_mask, other=0.0)
        tl.store(v_cache_ptr + cached, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(v_cache_ptr + cached + half, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def qkv_rope_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0
                   ) -> torch.Tensor:
    """q [N, num_heads, head_dim], normed and rotated; k (normed, rotated) and v go to the cache only."""
    num_tokens = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.stride(-1) == 1, f"qkv must be [N, width] with unit last stride, got {qkv.stride()}"
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim, f"qkv width {qkv.shape[1]} != heads x head_dim"
    assert head_dim % 2 == 0 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert slot_mapping.numel() == num_tokens
    assert (q_norm is None) == (k_norm is None), "q/k norm comes as a pair of weights or not at all"
    assert q_norm is None or q_norm.dtype == k_norm.dtype == qkv.dtype, "norm weights must be in the qkv dtype"
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out
    block_hq, block_half = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim // 2)
    has_norm = q_norm is not None
    _qkv_rope_store_kernel[(num_tokens,)](
        qkv, q_norm if has_norm else qkv, k_norm if has_norm else qkv, cos, sin, q_out, k_cache, v_cache,
        slot_mapping, qkv.stride(0), cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_heads, num_kv_heads, head_dim, eps,
        HAS_NORM=has_norm, PAGE_SIZE=k_cache.shape[1], BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=block_half,
        num_warps=elementwise_warps(block_hq * block_half),
    )
    return q_out
