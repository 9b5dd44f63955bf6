"""Plain-torch reference twins of the kernels: the CPU path, and the oracle the Triton kernels are tested against.

Shapes (N flattened new tokens of B sequences, H heads, D head size):
  k_cache, v_cache: [num_blocks, block_size, H_kv, D]
  slot_mapping:     [N] int64, slot = block_id * block_size + offset; -1 skips the token
  block_tables:     [B, max_blocks] int32, padded with -1
  cu_seqlens_q:     [B + 1] int32, sequence i owns rows cu[i]:cu[i+1] of q
  context_lens:     [B] int32, tokens of sequence i in the cache *including* its new ones
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence, [length, H_kv, D]."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context (prefill, chunked
    prefill, prefix-cache extend and decode are all this one case)."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    for i, length in enumerate(ctx):
        start, end = cu[i], cu[i + 1]
        if end == start:
            continue
        k = gather_kv(k_cache, block_tables[i], length).to(q.dtype).repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[i], length).to(q.dtype).repeat_interleave(group, dim=1)
        q_len = end - start
        q_pos = torch.arange(length - q_len, length, device=q.device)
        mask = q_pos[:, None] >= torch.arange(length, device=q.device)[None, :]
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        ).transpose(0, 1)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm in float32 like HF; with `residual`, adds it first and returns (normed, new residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), residual


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on [N, H, D] with cos/sin [N, D/2] gathered for each token's position."""
    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
