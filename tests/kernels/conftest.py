"""Kernel test helpers. Without a GPU the Triton kernels run in the interpreter on CPU tensors; with one,
the same tests run compiled on CUDA tensors (and the `gpu` tests add bf16/fp16 sweeps)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
# Triton reads TRITON_INTERPRET when it decorates its own library functions, i.e. at its first import.
INTERPRETER_READY = HAS_CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if INTERPRETER_READY:
        return
    reason = "triton was imported before TRITON_INTERPRET=1 could be set: run TRITON_INTERPRET=1 pytest tests/kernels"
    for item in items:
        if "tests/kernels" in str(item.fspath) and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def make_paged_kv(context_lens: list[int], num_kv_heads: int, head_dim: int, page_size: int,
                  dtype: torch.dtype = torch.float32, device: str = "cpu", extra_blocks: int = 3, seed: int = 0):
    """A random KV cache with shuffled, non-contiguous blocks per sequence and -1 padded block tables."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + page_size - 1) // page_size for n in context_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    k_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + 1  # always some -1 padding
    block_tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    return k_cache, v_cache, block_tables.to(device)


def cu_seqlens(q_lens: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def context_lens_tensor(lens: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(lens, dtype=torch.int32, device=device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
