"""Fused RMSNorm with optional residual add, one row per program (twin: reference.rms_norm).

Rounding follows the reference step by step (add in the input dtype, normalise in fp32, round, then
scale by the weight) so bf16 results match it bit for bit in most elements, not just within tolerance.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgate.kernels.config import elementwise_warps


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(x.dtype).to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.stride(-1) == 1 else t.contiguous().reshape(-1, t.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    r2 = _rows(residual) if residual is not None else x2
    ro2 = residual_out.view(-1, hidden) if residual_out is not None else x2
    out2 = out.view(-1, hidden)
    if x2.shape[0] == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out2, ro2, x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=elementwise_warps(block),
    )
    return out, residual_out
