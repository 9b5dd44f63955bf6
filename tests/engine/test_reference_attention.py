"""The reference paged attention's batched decode path and its per-sequence path agree with plain attention."""
from __future__ import annotations

import pytest
import torch

from kvgate.kernels import reference as R


def naive(q, k_cache, v_cache, tables, q_lens, ctx, scale):
    out = []
    group = q.shape[1] // k_cache.shape[2]
    row = 0
    for i, (n, c) in enumerate(zip(q_lens, ctx)):
        k = R.gather_kv(k_cache, tables[i], c).repeat_interleave(group, 1)
        v = R.gather_kv(v_cache, tables[i], c).repeat_interleave(group, 1)
        for r in range(n):
            pos = c - n + r
            s = torch.einsum("hd,thd->ht", q[row], k[:pos + 1]) * scale
            out.append(torch.einsum("ht,thd->hd", s.softmax(-1), v[:pos + 1]))
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("q_lens, ctx", [
    ([1, 1, 1, 1], [1, 17, 5, 32]),  # decode only: one batched call, padded tables
    ([1] * 6, [4, 3, 5, 8, 1, 29]),  # decode only: contexts on, before and after block boundaries
    ([5, 1, 1, 2, 1], [5, 1, 9, 3, 7]),  # prefill, decode and a cached-prefix extend mixed
    ([1], [13]),  # a lone decode takes the per-sequence path
])
def test_paged_attention_matches_plain_attention(q_lens, ctx):
    q, k_cache, v_cache, tables, cu = random_case(q_lens, ctx)
    out = R.paged_attention(q, k_cache, v_cache, tables, cu, torch.tensor(ctx, dtype=torch.int32), 0.3)
    torch.testing.assert_close(out, naive(q, k_cache, v_cache, tables, q_lens, ctx, 0.3), atol=1e-5, rtol=1e-5)


def test_a_decode_row_without_context_gets_zeros_and_the_others_are_exact():
    q, k_cache, v_cache, tables, cu = random_case([1, 1, 1], [9, 1, 6])
    ctx = torch.tensor([9, 0, 6], dtype=torch.int32)
    out = R.paged_attention(q, k_cache, v_cache, tables, cu, ctx, 0.3)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = [0, 2]
    torch.testing.assert_close(out[keep], naive(q[keep], k_cache, v_cache, tables[keep], [1, 1], [9, 6], 0.3),
                               atol=1e-5, rtol=1e-5)


def random_case(q_lens, ctx):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs, num_blocks = 6, 2, 8, 4, 48
    k_cache, v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=g), torch.randn(num_blocks, bs, kv_heads, dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(ctx), 8), -1, dtype=torch.int32)
    for i, c in enumerate(ctx):
        for j in range(-(-c // bs)):
            tables[i, j] = free.pop()
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, dim, generator=g)
    return q, k_cache, v_cache, tables, cu
