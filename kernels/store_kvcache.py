"""Write the K/V of new tokens into the paged cache at their slots (twin: reference.store_kvcache)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                          key_stride_n, key_stride_h, value_stride_n, value_stride_h,
                          cache_stride_b, cache_stride_t, cache_stride_h, num_kv_heads, head_dim,
                          PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (e.g. a CUDA-graph slot with no sequence)
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    key = tl.load(key_ptr + token * key_stride_n + heads * key_stride_h + dims, mask=mask)
    value = tl.load(value_ptr + token * value_stride_n + heads * value_stride_h + dims, mask=mask)
    dst = (slot // PAGE_SIZE) * cache_stride_b + (slot % PAGE_SIZE) * cache_stride_t + heads * cache_stride_h + dims
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "last dim of key/value must be contiguous"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert slot_mapping.numel() == num_tokens
    if num_tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_kv_heads, head_dim,
        PAGE_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=min(8, max(1, block_h * block_d // 512)),
    )
