"""The structured-output token mask: the Triton kernel (interpreter on the CPU, compiled on a GPU) and the CPU's
compiled loop against the torch twin, and the twin against the definition, bit by bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvgate.kernels import reference
from kvgate.kernels.cpu_mask import apply_token_bitmask as cpu_apply
from kvgate.kernels.token_mask import apply_token_bitmask
from tests.kernels.kernel_testing import DEVICE


def masks(rows: int, words: int, seed: int) -> torch.Tensor:
    """Random words plus the two kinds the loops take shortcuts for: all allowed (-1) and none (0)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    bits[:, ::3] = -1
    bits[:, 1::5] = 0
    return bits


def by_definition(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r, row in enumerate(rows):
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= bitmask.shape[1] or not (int(bitmask[r, w]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab,words", [(100, 4), (64, 2), (130, 3)])  # exact, and wider than the grammar's words
def test_the_twin_blocks_exactly_the_clear_bits_and_every_token_past_the_words(vocab, words):
    logits, bitmask, rows = torch.randn(5, vocab), masks(3, words, vocab), [4, 0, 2]
    expected = by_definition(logits, bitmask, rows)
    reference.apply_token_bitmask(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("vocab,words,batch,rows", [
    (49_152, 1_536, 6, [0, 1, 2, 3, 4, 5]),  # SmolLM2's vocabulary, every row constrained
    (1_000, 32, 7, [6, 1, 3]),  # some rows, out of order; vocab not a multiple of 32 or of the block
    (2_100, 60, 4, [2]),  # logits wider than the grammar's words
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the sampler masks a bf16 model's own
def test_the_triton_kernel_equals_the_twin(vocab, words, batch, rows, dtype):
    logits = torch.randn(batch, vocab, device=DEVICE).to(dtype)
    bitmask, index = masks(len(rows), words, vocab).to(DEVICE), torch.tensor(rows, device=DEVICE)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, index)
    apply_token_bitmask(logits, bitmask, index)
    assert torch.equal(logits, expected)
    untouched = [r for r in range(batch) if r not in rows]
    assert torch.isfinite(logits[untouched]).all()


@pytest.mark.parametrize("vocab,words,batch,rows", [
    (49_152, 1_536, 64, list(range(64))), (1_000, 32, 7, [6, 1, 3]), (2_100, 60, 4, [2]), (33, 2, 1, [0])])
def test_the_cpu_loop_equals_the_twin(vocab, words, batch, rows):
    logits = torch.randn(batch, vocab)
    bitmask = masks(len(rows), words, vocab + 1)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, torch.tensor(rows))
    cpu_apply(logits.numpy(), np.asarray(rows, dtype=np.int64), bitmask.numpy())
    assert torch.equal(logits, expected)


def test_the_cpu_loop_refuses_logits_it_was_not_compiled_for():
    with pytest.raises(TypeError):
        cpu_apply(np.zeros((2, 64), dtype=np.float64), np.zeros(1, dtype=np.int64), np.zeros((1, 2), dtype=np.int32))
