"""A structured-output batch's token mask applied to the logits on the GPU (twin: reference.apply_token_bitmask).

llguidance fills one bitmask row per constrained sequence on the CPU while the forward runs ([rows, words] int32,
token t allowed where bit t % 32 of word t // 32 is set). The words go to the device (32x fewer bytes than booleans)
and this kernel writes -inf over the disallowed tokens of those rows, in place, one program per (row, block of
tokens): a store only where a token is blocked, no [rows, vocab] boolean tensor and no gather or scatter of rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgate.kernels.config import elementwise_warps

BLOCK = 1024  # tokens per program: a fixed tile, so one compiled variant serves every vocabulary and batch


@triton.jit(do_not_specialize=["stride_l", "stride_b", "vocab", "words"])
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, stride_l, stride_b, vocab, words,
                                BLOCK: tl.constexpr):
    r = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + r).to(tl.int64)
    in_vocab = tokens < vocab
    word_index = tokens >> 5
    covered = in_vocab & (word_index < words)  # past the grammar's words nothing is allowed
    word = tl.load(bitmask_ptr + r.to(tl.int64) * stride_b + word_index, mask=covered, other=0)
    allowed = ((word >> (tokens & 31)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + tokens, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place over `logits` [batch, vocab] (last dimension contiguous): row rows[r] takes bitmask[r]'s mask.
    `bitmask` [len(rows), words] int32 and `rows` (int32/int64) live on the logits' device."""
    if rows.numel() == 0:
        return
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_token_bitmask needs the logits' and bitmask's last dimension contiguous")
    vocab = logits.shape[1]
    grid = (rows.numel(), triton.cdiv(vocab, BLOCK))
    _apply_token_bitmask_kernel[grid](logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab,
                                      bitmask.shape[1], BLOCK=BLOCK, num_warps=elementwise_warps(BLOCK))
