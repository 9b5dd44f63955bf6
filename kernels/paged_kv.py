"""Device helpers shared by the attention kernels: gather a KV tile through a block table, and one
step of the online (flash) softmax. Scores are kept in log2 units so the kernels use exp2."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_tile_offsets(block_table_row_ptr, tokens, token_mask, kv_head_offset, dims,
                    stride_block, stride_token, page_size):
    """Element offsets [BLOCK_N, BLOCK_D] of `tokens` of one sequence and KV head in the paged cache.

    Block ids are only read for tokens inside the context, so -1 padding is never dereferenced;
    int64 because num_blocks * block stride overflows int32 on large caches."""
    block = tl.load(block_table_row_ptr + tokens // page_size, mask=token_mask, other=0).to(tl.int64)
    rows = block * stride_block + (tokens % page_size) * stride_token + kv_head_offset
    return rows[:, None] + dims[None, :]


@triton.jit
def online_softmax_step(scores, m_i, l_i, acc, v, PRECISION: tl.constexpr):
    """Fold one tile of (masked, log2-scaled) scores and its values into the running max, sum and output."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


def dot_precision(dtype) -> str:
    # fp32 models must match the reference exactly enough for greedy parity: no TF32.
    import torch
    return "ieee" if dtype == torch.float32 else "tf32"


LOG2E = 1.4426950408889634
