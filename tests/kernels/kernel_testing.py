"""Inputs and comparisons shared by the kernel tests (a plain module: every test folder has a conftest)."""
from __future__ import annotations

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def make_paged_kv(context_lens: list[int], num_kv_heads: int, head_dim: int, page_size: int,
                  dtype: torch.dtype = torch.float32, device: str = "cpu", extra_blocks: int = 3, seed: int = 0):
    """A random KV cache with shuffled, non-contiguous blocks per sequence and -1 padded block tables."""
    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: GPU sweeps build GBs of cache
    blocks_per_seq = [(n + page_size - 1) // page_size for n in context_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    shape = (num_blocks, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
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
