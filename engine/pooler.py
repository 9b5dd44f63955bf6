"""An embedding request's vector, from the final hidden states (after the last norm) of its prompt's tokens.

A long prompt is computed in chunks (the step's token budget), so the pooled value is built chunk by chunk on the
sequence: a mean adds each chunk's sum, `cls` keeps the first token's state, `last` the last one's. A chunk starting
at position 0 starts over (a preempted request computes its prompt again)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvgate.engine.sequence import Sequence


def accumulate(seq: Sequence, rows: torch.Tensor, start: int) -> None:
    """Take in the hidden states of the prompt positions [start, start + len(rows)); once the prompt is complete,
    `seq.embedding` holds the finished vector."""
    how, end = seq.pooling.pooling, start + len(rows)
    if start == 0:
        seq.pooled = None
    if how == "mean":
        total = rows.sum(0, dtype=torch.float32)
        seq.pooled = total if seq.pooled is None else seq.pooled + total
    elif how == "cls" and start == 0:
        seq.pooled = rows[0].float()
    elif how == "last" and end == seq.num_prompt_tokens:
        seq.pooled = rows[-1].float()
    if end == seq.num_prompt_tokens:
        seq.embedding = finish(seq.pooled / end if how == "mean" else seq.pooled, seq.pooling.dimensions,
                               seq.pooling.normalize)
        seq.pooled = None


def finish(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> bytes:
    """The vector as the wire carries it: float32 little-endian bytes, cut to `dimensions`, then to unit length."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = F.normalize(vector, dim=0)
    return vector.to("cpu", torch.float32).numpy().astype("<f4").tobytes()
