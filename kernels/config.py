"""Launch configurations: tile sizes and warps/stages per kernel, by GPU generation and head size.

The table is small on purpose: a handful of shapes covers the Llama family (head size 64 or 128).
CPU tensors only ever run under TRITON_INTERPRET=1, where small tiles keep the tests fast and
still cross tile and page boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

import torch
from triton.runtime.errors import OutOfResources


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


def prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> AttentionConfig:
    arch = _arch(device)
    if arch == 0:
        return AttentionConfig(16, 16, 1, 1)
    if dtype == torch.float32:  # parity runs: twice the shared memory per tile
        return AttentionConfig(64, 32, 4, 2 if arch >= 9 else 1)
    if arch >= 9:  # Hopper: large smem, deep pipelines pay off
        return AttentionConfig(128, 64, 8 if head_dim > 64 else 4, 3)
    if arch == 8:
        return AttentionConfig(64, 64, 4, 3 if head_dim <= 64 else 2)
    return AttentionConfig(64, 32, 4, 2)


def decode_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> AttentionConfig:
    # Decode is bandwidth bound: block_m only pads the GQA group to the minimum dot size (16).
    arch = _arch(device)
    if arch == 0:
        return AttentionConfig(16, 16, 1, 1)
    if dtype == torch.float32:
        return AttentionConfig(16, 32, 4, 2)
    if arch >= 9:
        return AttentionConfig(16, 64, 4, 3)
    return AttentionConfig(16, 64, 4, 2)


def smaller(config: AttentionConfig) -> AttentionConfig | None:
    """The next config to try when a launch needs more shared memory than the GPU has."""
    if config.num_stages > 1:
        return replace(config, num_stages=config.num_stages - 1)
    if config.block_n > 16:
        return replace(config, block_n=config.block_n // 2)
    if config.block_m > 16:
        return replace(config, block_m=config.block_m // 2)
    return None


_fitted: dict[tuple, AttentionConfig] = {}


def launch_fitted(key: tuple, config: AttentionConfig, launch: Callable[[AttentionConfig], None]) -> None:
    """Launch with the table's config, stepping down until it fits this GPU; remember what fitted per key
    so the search (a failed compile each step) happens once per shape class, before any graph capture."""
    key = (*key, config)
    config = _fitted.get(key, config)
    while True:
        try:
            launch(config)
        except OutOfResources:
            config = smaller(config)
            if config is None:
                raise
            continue
        _fitted[key] = config
        return


def elementwise_warps(block: int) -> int:
    """Warps for one-row-per-program kernels (norm, rotary, activation)."""
    return max(1, min(16, block // 256))
