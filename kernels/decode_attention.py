"""Paged decode attention, one new query per sequence, GQA, split along the context by fixed work (flash-decoding).

Stage 1: program (sequence, KV head, split k) attends the group's query heads to tokens [k * chunk, (k + 1) * chunk)
of its sequence (and to chunks k + num_splits, k + 2 * num_splits, ... where the context has more chunks than there
are splits) and writes a partial output and log-sum-exp; a program whose split starts past its sequence's context
exits at once. Stage 2 merges the splits that start inside the context (it counts them from the context
length, so what an exited program left in the partial buffers is never read, and a CUDA-graph padding row with
context 0 merges nothing: zeros, not NaN). With one split stage 1 writes the final output directly.

Why fixed work (issue 41): dividing each sequence's own context by a split count chosen for occupancy gave a big
batch with few KV heads (B=256 x 2 for qwen2.5-0.5b) one split, so every program walked its whole context and the
batch waited for its longest ones. A chunk of at most CHUNK tokens keeps programs short whatever the lengths mix.

The split count and chunk come from the block-table width (the most context the batch can have), the batch size
and the SM count, never from the context lengths: nothing syncs with the host and the launch is CUDA-graph safe.
The chunk is a multiple of BLOCK_N and of the page size, CHUNK at most, and smaller (down to MIN_CHUNK) when
CHUNK-sized splits would launch less than one wave of programs over the SMs.

Past MAX_SPLITS * CHUNK tokens (16384) of table width neither MAX_SPLITS nor the chunk grows: a program takes every
num_splits-th chunk of its sequence. Raising MAX_SPLITS would launch mostly empty programs for every short batch
of a long-context model (the launch is batch x KV heads x splits whatever the lengths, and the engine's captured
graphs size the block table by max_model_len) and widen the reduce's one BLOCK_S tile; growing the chunk would give
a 2048-token sequence one program again whenever the table is 64k wide. Striding keeps 512-token splits for the
short sequences and spreads a long one over MAX_SPLITS programs per KV head.
Twin: reference.paged_attention restricted to q_len == 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kvgate.kernels.config import AttentionConfig, decode_config, launch_fitted
from kvgate.kernels.paged_kv import LOG2E, dot_precision, kv_tile_offsets, online_softmax_step

CHUNK = 512  # the most context tokens one program attends while MAX_SPLITS chunks cover the table
MIN_CHUNK = 128  # below this a split's partial output (group x head_dim fp32) costs a noticeable share of its KV reads
MAX_SPLITS = 32


# Integer arguments that vary with the batch (its block-table width, the split count and chunk) are not specialised:
# Triton would compile a variant for each value of 1 and each multiple of 16 (issue 28: ~150 compiles on a cold cache).
@triton.jit(do_not_specialize=("stride_bt", "num_splits", "chunk"))
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                         out_ptr, part_out_ptr, part_lse_ptr, scale_log2,
                         stride_qn, stride_qh, stride_on, stride_oh,
                         stride_cb, stride_ct, stride_ch, stride_bt,
                         num_heads, group, head_dim, num_splits, chunk, PAGE_SIZE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    first = split * chunk
    if SPLIT:
        if first >= ctx:  # past this sequence's context: the reduce merges only splits that start inside it
            return
    q_row = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) == q_row:
        return

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * group + g
    head_mask = g < group
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(first, ctx, num_splits * chunk):  # chunks split, split + num_splits, ... of the context
        end = tl.minimum(start + chunk, ctx)
        for t0 in range(start, end, BLOCK_N):
            tokens = t0 + tl.arange(0, BLOCK_N)
            token_mask = tokens < end
            offs = kv_tile_offsets(table, tokens, token_mask, kv_head * stride_ch, dims, stride_cb, stride_ct,
                                   PAGE_SIZE)
            kv_mask = token_mask[:, None] & dim_mask[None, :]
            k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            scores = tl.where(token_mask[None, :], scores, float("-inf"))
            m_i, l_i, acc = online_softmax_step(scores, m_i, l_i, acc, v, PRECISION)

    # only an unsplit padding row (context 0) gets here having attended nothing: its output is zero
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_safe), mask=head_mask)
        tl.store(part_out_ptr + part[:, None] * head_dim + dims[None, :], out,
                 mask=head_mask[:, None] & dim_mask[None, :])
    else:
        tl.store(out_ptr + q_row.to(tl.int64) * stride_on + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])


@triton.jit(do_not_specialize=("num_splits", "chunk"))
def _decode_reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                          stride_on, stride_oh, num_heads, head_dim, num_splits, chunk,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    q_row = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) == q_row:
        return
    # the splits stage 1 ran for this sequence; the others exited without writing their partials
    ran = tl.minimum(tl.cdiv(tl.load(context_lens_ptr + seq), chunk), num_splits)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < ran
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    part = (seq * num_heads + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=split_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    # A CUDA-graph padding row has no context: no split ran and its output is zero, not NaN.
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    partial = tl.load(part_out_ptr + part[:, None] * head_dim + dims[None, :],
                      mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + q_row.to(tl.int64) * stride_on + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_mask)


@dataclass(frozen=True, slots=True)
class Splits:
    num_splits: int  # programs per (sequence, KV head)
    chunk: int  # split k attends [k * chunk, (k + 1) * chunk), then every num_splits-th chunk after it


@lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def round_up(n: int, granule: int) -> int:
    return triton.cdiv(n, granule) * granule


def choose_splits(batch: int, num_kv_heads: int, max_context: int, granule: int, sms: int) -> Splits:
    """Chunks of CHUNK tokens (a multiple of `granule`), smaller when that leaves the launch short of one program per
    SM; as many splits as chunks cover `max_context`, at most MAX_SPLITS."""
    max_context = max(max_context, 1)
    chunk = round_up(CHUNK, granule)
    wave = min(triton.cdiv(sms, batch * num_kv_heads), MAX_SPLITS)  # splits per (sequence, KV head) to fill the SMs
    if wave > triton.cdiv(max_context, chunk):  # rounded down, so the wave is met wherever MIN_CHUNK allows
        chunk = max(round_up(MIN_CHUNK, granule), max_context // wave // granule * granule)
    chunk = min(chunk, round_up(max_context, granule))  # a table shorter than one chunk: its own length
    return Splits(min(triton.cdiv(max_context, chunk), MAX_SPLITS), chunk)


def decode_splits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, num_splits: int | None = None,
                  chunk: int | None = None, config: AttentionConfig | None = None) -> Splits:
    """The split count and chunk decode_attention launches with for these shapes. Tests may force either: a forced
    `num_splits` alone takes the chunk that covers the table in that many splits."""
    page_size = k_cache.shape[1]
    config = config or decode_config(q.shape[-1], q.dtype, q.device)
    max_context = max(block_tables.shape[1] * page_size, 1)
    assert num_splits is None or 1 <= num_splits <= MAX_SPLITS, "the reduce merges at most MAX_SPLITS partials"
    if chunk is not None:
        return Splits(num_splits or min(triton.cdiv(max_context, chunk), MAX_SPLITS), chunk)
    if num_splits is not None:
        return Splits(num_splits, round_up(triton.cdiv(max_context, num_splits), config.block_n))
    return choose_splits(q.shape[0], k_cache.shape[2], max_context, math.lcm(config.block_n, page_size),
                         multiprocessor_count(q.device))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     num_splits: int | None = None, chunk: int | None = None,
                     config: AttentionConfig | None = None) -> torch.Tensor:
    """q: [B, H, D], one row per sequence (cu_seqlens_q == arange(B + 1))."""
    batch = cu_seqlens_q.numel() - 1
    _, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    config = config or decode_config(head_dim, q.dtype, q.device)
    splits = decode_splits(q, k_cache, block_tables, num_splits, chunk, config)
    num_splits, chunk = splits.num_splits, splits.chunk
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device) if split else out
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device) if split else out

    def launch(cfg: AttentionConfig) -> None:
        _decode_split_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, part_out, part_lse, scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            num_heads, group, head_dim, num_splits, chunk, PAGE_SIZE=page_size,
            BLOCK_G=max(cfg.block_m, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n, BLOCK_D=block_d,
            SPLIT=split, PRECISION=dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    launch_fitted(("decode", q.device, q.dtype, k_cache.dtype, head_dim, group), config, launch)
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            out, part_out, part_lse, cu_seqlens_q, context_lens, out.stride(0), out.stride(1), num_heads, head_dim,
            num_splits, chunk,
            # one BLOCK_S for every split count: one variant, not one per power of two
            BLOCK_S=MAX_SPLITS, BLOCK_D=block_d, num_warps=4 if block_d >= 128 else 2,
        )
    return out
