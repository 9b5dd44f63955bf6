"""The kernel entry points the engine calls: Triton on CUDA tensors, the torch reference twins elsewhere."""
from __future__ import annotations

from kernels.reference import paged_attention, rms_norm, rotary, silu_and_mul, store_kvcache

__all__ = ["store_kvcache", "paged_attention", "rms_norm", "rotary", "silu_and_mul"]
