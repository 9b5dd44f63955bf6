"""SiLU(gate) * up over the two halves of the MLP's fused gate/up projection (twin: reference.silu_and_mul)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # Round silu to the input dtype before the product, as torch does in two ops.
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    inner = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().reshape(-1, x.shape[-1])
    out = torch.empty(*x.shape[:-1], inner, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or inner == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(inner))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inner, block))](
        x2, out.view(-1, inner), x2.stride(0), inner, inner, BLOCK=block, num_warps=4 if block >= 512 else 1,
    )
    return out
