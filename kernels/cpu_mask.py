"""A structured-output batch's token mask applied to the logits on the CPU, as one compiled loop (numba;
twin: reference.apply_token_bitmask).

The torch/numpy way unpacks the bits into a [rows, vocab] boolean array and masked-fills the logits through it:
two passes over rows x vocab (49,152 tokens for SmolLM2) plus the booleans' allocation. This walks each row's words
once: an all-ones word (32 allowed tokens: most of a row inside a JSON string) costs one comparison, an all-zero word
(most of a row at a structural position) 32 stores, rows in parallel. Importing compiles it (numba's cache after the
first time); the engine imports it only when it masks on the CPU, and keeps the twin where numba cannot be imported.
"""
from __future__ import annotations

import numba
import numpy as np

NINF = np.float32(-np.inf)


@numba.njit(["void(float32[:, ::1], int64[::1], int32[:, ::1])"], parallel=True, cache=True, nogil=True)
def apply_token_bitmask(logits, rows, words):
    """In place: logits[rows[r], t] = -inf where bit t % 32 of words[r, t // 32] is clear; tokens past the words'
    32 * n are never allowed."""
    vocab, n_words = logits.shape[1], words.shape[1]
    for r in numba.prange(rows.shape[0]):
        row, mask = logits[rows[r]], words[r]
        covered = min(n_words * 32, vocab)
        for w in range(n_words):
            x = mask[w]
            if x == -1:
                continue
            start = w * 32
            end = min(start + 32, vocab)
            if x == 0:
                for t in range(start, end):
                    row[t] = NINF
            else:
                for t in range(start, end):
                    if not (x >> (t - start)) & 1:
                        row[t] = NINF
        for t in range(covered, vocab):
            row[t] = NINF
