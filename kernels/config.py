"""Launch configurations: tile sizes and warps/stages per kernel, by GPU generation and head size.

The table is small on purpose: a handful of shapes covers the Llama family (head size 64 or 128).
CPU tensors only ever run under TRITON_INTERPRET=1, where small tiles keep the tests fast and
still cross tile and page boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    block_m: int  # query rows per program (prefill) / padded query heads per KV head (decode)
    block_n: int  # KV tokens per inner-loop tile
    num_warps: int
    num_stages: int


@lru_cache(maxsize=None)
def _arch(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    major, _ = torch.cuda.get_device_capability(device)
    return major


def prefill_config(head_dim: int, device: torch.device) -> AttentionConfig:
    arch = _arch(device)
    if arch == 0:
        return AttentionConfig(16, 16, 1, 1)
    if arch >= 9:  # Hopper: large smem, deep pipelines pay off
        return AttentionConfig(128, 64, 8 if head_dim > 64 else 4, 3)
    if arch == 8:
        return AttentionConfig(64, 64, 4, 3 if head_dim <= 64 else 2)
    return AttentionConfig(64, 32, 4, 2)


def decode_config(head_dim: int, device: torch.device) -> AttentionConfig:
    # Decode is bandwidth bound: block_m only pads the GQA group to the minimum dot size (16).
    arch = _arch(device)
    if arch == 0:
        return AttentionConfig(16, 16, 1, 1)
    if arch >= 9:
        return AttentionConfig(16, 64, 4, 3)
    return AttentionConfig(16, 64, 4, 2)


def elementwise_warps(block: int) -> int:
    """Warps for one-row-per-program kernels (norm, rotary, activation)."""
    return max(1, min(16, block // 256))
