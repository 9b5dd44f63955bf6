"""Paged prefill / extend attention: each sequence's new queries attend causally to every cached token
of that sequence (the K/V of the new tokens are stored first). Covers a whole prompt, a chunk of a
chunked prefill, and a prompt whose prefix came from the prefix cache. Twin: reference.paged_attention.

Program (query tile, head). Query tiles are numbered across the batch; each program finds its
sequence from a prefix sum of tiles per sequence computed in the kernel, so the grid (total tokens /
BLOCK_M + batch, an upper bound) needs no host sync and a batch of short rows beside one long chunk
launches no idle programs per sequence. A sequence's last tiles see the most KV, so they go first.
KV tiles left of the causal diagonal run without masks; only the diagonal tiles pay for them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgate.kernels.config import AttentionConfig, launch_fitted, prefill_config
from kvgate.kernels.paged_kv import LOG2E, dot_precision, kv_tile_offsets, online_softmax_step

BATCH_BLOCK = 64  # sequences whose starts one prefill program scans at once (a masked load of 64 ints)


@triton.jit
def _attend_range(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, kv_head_offset, q_pos, dims, dim_mask,
                  lo, hi, scale_log2, stride_cb, stride_ct, PAGE_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    for t0 in range(lo, hi, BLOCK_N):
        tokens = t0 + tl.arange(0, BLOCK_N)
        token_mask = tokens < hi
        offs = kv_tile_offsets(table, tokens, token_mask, kv_head_offset, dims, stride_cb, stride_ct, PAGE_SIZE)
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if CAUSAL:
            scores = tl.where(token_mask[None, :] & (tokens[None, :] <= q_pos[:, None]), scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(scores, m_i, l_i, acc, v, PRECISION)
    return m_i, l_i, acc


# The batch and its block-table width vary step by step: not specialised, and one BLOCK_B up to BATCH_BLOCK
# sequences, so a cold cache compiles one variant where it compiled one per power of two (issue 28).
@triton.jit(do_not_specialize=("stride_bt", "batch"))
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                    out_ptr, scale_log2, stride_qn, stride_qh, stride_on, stride_oh,
                    stride_cb, stride_ct, stride_ch, stride_bt, batch, group, head_dim, PAGE_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
                    PRECISION: tl.constexpr):
    program, head = tl.program_id(0), tl.program_id(1)
    b = tl.arange(0, BLOCK_B)
    starts = tl.load(cu_seqlens_q_ptr + b, mask=b < batch, other=0)
    tiles = (tl.load(cu_seqlens_q_ptr + b + 1, mask=b < batch, other=0) - starts + BLOCK_M - 1) // BLOCK_M
    seq = tl.sum((tl.cumsum(tiles, 0) <= program).to(tl.int32), 0)
    if seq >= batch:
        return
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_tiles = (q_len + BLOCK_M - 1) // BLOCK_M
    tile = seq_tiles - 1 - (program - tl.sum(tl.where(b < seq, tiles, 0), 0))
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len  # tokens cached before this chunk (prefix cache hit or earlier chunks)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = prefix + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q_offs = (q_start + rows).to(tl.int64)[:, None] * stride_qn + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_offset = (head // group) * stride_ch
    # Every token before the tile's first query position is visible to all its rows.
    diagonal = (prefix + tile * BLOCK_M) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(ctx, prefix + (tile + 1) * BLOCK_M)
    m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, kv_head_offset, q_pos, dims,
                                  dim_mask, 0, diagonal, scale_log2, stride_cb, stride_ct, PAGE_SIZE,
                                  BLOCK_N, False, PRECISION)
    m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, kv_head_offset, q_pos, dims,
                                  dim_mask, diagonal, kv_end, scale_log2, stride_cb, stride_ct, PAGE_SIZE,
                                  BLOCK_N, True, PRECISION)
    out = acc / l_i[:, None]
    o_offs = (q_start + rows).to(tl.int64)[:, None] * stride_on + head * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                      config: AttentionConfig | None = None) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    num_kv_heads = k_cache.shape[2]
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    config = config or prefill_config(head_dim, q.dtype, q.device)
    out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out

    def launch(cfg: AttentionConfig) -> None:
        _prefill_kernel[(triton.cdiv(num_tokens, cfg.block_m) + batch, num_heads)](
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            batch, num_heads // num_kv_heads, head_dim, PAGE_SIZE=k_cache.shape[1],
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_B=max(BATCH_BLOCK, triton.next_power_of_2(batch)), PRECISION=dot_precision(q.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    launch_fitted(("prefill", q.device, q.dtype, k_cache.dtype, head_dim), config, launch)
    return out
