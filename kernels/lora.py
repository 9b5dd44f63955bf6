"""Batched LoRA over a step that mixes adapters (Punica's BGMV: one row, its own adapter; twin: reference.lora_apply).

Per row n, `rows[n]` (kernels/lora_rows.py's LoraRows.rows) is the device slot of its adapter (-1: the base model,
no delta). A projection's adapters are stacked by slot: `a` [S, R, in] holds every slice's shrink matrix
(R = slices x max rank, a fused q/k/v has three), `bs[i]` [S, r, out_i] slice i's expand matrix, transposed, its
scaling folded in. Two launches per slice set:
shrink  t[n, :] = a[rows[n]] @ x[n]                  (float32, [N, R])
expand  y[n, off_i:off_i + out_i] += t[n, i*r:(i+1)*r] @ bs[i][rows[n]]
Each program takes one row and a tile of its outputs, so one launch serves every adapter of the batch at once; no
loop over adapters. Base rows are masked out of every load and store."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgate.kernels.lora_rows import LoraRows

BLOCK_OUT = 64
BLOCK_K = 64


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, rows_ptr, t_ptr, stride_x, stride_as, stride_ar, stride_t, in_features, rank_total,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(rows_ptr + row).to(tl.int64)
    rank_limit = tl.where(slot >= 0, rank_total, 0)  # a base row loads and stores nothing
    in_limit = tl.where(slot >= 0, in_features, 0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < rank_limit
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_base = a_ptr + tl.maximum(slot, 0) * stride_as
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_limit
        x = tl.load(x_ptr + row * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_base + r[:, None] * stride_ar + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(t_ptr + row * stride_t + r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(t_ptr, b_ptr, rows_ptr, y_ptr, stride_t, stride_bs, stride_br, stride_y, t_offset, y_offset, rank,
                   out_features, BLOCK_R: tl.constexpr, BLOCK_OUT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(rows_ptr + row).to(tl.int64)
    out_limit = tl.where(slot >= 0, out_features, 0)  # a base row loads and stores nothing
    o = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    o_mask = o < out_limit
    b_base = b_ptr + tl.maximum(slot, 0) * stride_bs
    acc = tl.zeros((BLOCK_OUT,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rank
        t = tl.load(t_ptr + row * stride_t + t_offset + r, mask=r_mask, other=0.0)
        b = tl.load(b_base + r[:, None] * stride_br + o[None, :], mask=r_mask[:, None] & o_mask[None, :], other=0.0)
        acc += tl.sum(t[:, None] * b.to(tl.float32), axis=0)
    y_at = y_ptr + row * stride_y + y_offset + o
    y = tl.load(y_at, mask=o_mask, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=o_mask)


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor], offsets: list[int],
               segments: LoraRows) -> torch.Tensor:
    """y [N, out] += each row's adapter delta, in place; returns y. x [N, in] (rows contiguous); a row's slot is
    `segments.rows[n]` (the segments themselves are the CPU twin's)."""
    rows = segments.rows
    n, in_features = x.shape
    if n == 0:
        return y
    x = x if x.stride(-1) == 1 else x.contiguous()
    rank_total = a.shape[1]
    t = torch.empty(n, rank_total, dtype=torch.float32, device=x.device)
    block_r = triton.next_power_of_2(min(rank_total, 64))
    _shrink_kernel[(n, triton.cdiv(rank_total, block_r))](
        x, a, rows, t, x.stride(0), a.stride(0), a.stride(1), t.stride(0), in_features, rank_total,
        BLOCK_R=block_r, BLOCK_K=BLOCK_K)
    for i, (b, offset) in enumerate(zip(bs, offsets)):
        rank, out_features = b.shape[1], b.shape[2]
        _expand_kernel[(n, triton.cdiv(out_features, BLOCK_OUT))](
            t, b, rows, y, t.stride(0), b.stride(0), b.stride(1), y.stride(0), i * rank, offset, rank, out_features,
            BLOCK_R=triton.next_power_of_2(min(rank, 32)), BLOCK_OUT=BLOCK_OUT)
    return y
