"""The decode graphs' inputs (issue 41): named views of one packed device buffer, filled each step by one
host-to-device copy of a packed host buffer of the same layout, padding rows included.

The layout: the int64 fields, each [rows], then the int32 ones, context lengths [rows] and block tables
[rows, max_blocks] last, so a bucket of s rows needs the buffer's prefix up to block table row s: one contiguous
copy. The host writes each field's first n rows and the padding values of rows n..s (`PADDING`: store nothing,
attend to nothing), so no fill and no cast runs on the device. Two host buffers take turns: a step writes one
while the copy queued from the other a step before may still be in flight (a step launched ahead,
engine/overlap.py); on CUDA they are pinned and an event says when a buffer's last copy has been read.

`prev` is each row's index in the step before, whose sampled token (still on the device) is the row's input,
or -1 where the host has the token in `input_ids`: the graph picks the token itself (cuda_graphs.py)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np
import torch

T = TypeVar("T", torch.Tensor, np.ndarray)


@dataclass(slots=True)
class InputViews(Generic[T]):
    """The fields of a packed buffer: torch views on the device, numpy views on the host."""
    input_ids: T  # [rows] int64
    positions: T  # [rows] int64
    slot_mapping: T  # [rows] int64
    prev: T  # [rows] int64: the row of the step before whose token is this row's input; -1: input_ids has it
    context_lens: T  # [rows] int32
    block_tables: T  # [rows, max_blocks] int32

    @classmethod
    def of(cls, buffer: torch.Tensor, rows: int, max_blocks: int) -> InputViews[torch.Tensor]:
        wide = buffer[:len(WIDE) * rows * 8].view(torch.int64).view(len(WIDE), rows)
        narrow = buffer[len(WIDE) * rows * 8:].view(torch.int32)
        return cls(*wide, narrow[:rows], narrow[rows:].view(rows, max_blocks))


WIDE = ("input_ids", "positions", "slot_mapping", "prev")  # int64, in the layout's order
PADDING = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "prev": -1, "context_lens": 0, "block_tables": -1}
assert [f.name for f in fields(InputViews)] == [*WIDE, "context_lens", "block_tables"] == list(PADDING)


def packed_bytes(rows: int, max_blocks: int) -> int:
    return len(WIDE) * rows * 8 + rows * 4 + rows * max_blocks * 4


class StaticInputs:
    """The device buffer whose views a graph captured, and the host buffers a step writes and copies into it."""

    def __init__(self, rows: int, max_blocks: int, device: torch.device) -> None:
        self.rows, self.max_blocks, self.device = rows, max_blocks, device
        nbytes = packed_bytes(rows, max_blocks)
        pinned = device.type == "cuda"
        self.host_buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self.hosts = [InputViews(*(t.numpy() for t in astuple(InputViews.of(b, rows, max_blocks))))
                      for b in self.host_buffers]
        self.copied: list[torch.cuda.Event | None] = [None, None]  # each host buffer's last copy, once read
        self.turn = 0
        for host in self.hosts:  # every row a padding row until a step writes it
            for name, value in PADDING.items():
                getattr(host, name).fill(value)
        self.buffer = self.host_buffers[0].to(device, copy=True)  # once: what the graphs are captured over
        self.views = InputViews.of(self.buffer, rows, max_blocks)
        self.cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one query row each, always
        self.copies = 0  # steps sent, for stats and tests

    def stage(self) -> InputViews[np.ndarray]:
        """The host buffer this step writes, once the device has read what was copied from it before."""
        event = self.copied[self.turn]
        if event is not None:
            event.synchronize()
        return self.hosts[self.turn]

    def write(self, n: int, size: int, **values: np.ndarray) -> None:
        """A step of n rows in the bucket of `size` rows: each field's first n rows and the padding of the rest,
        on the host, then one copy of the bucket's prefix of the layout to the device."""
        if values.keys() != PADDING.keys():
            raise ValueError(f"a decode step writes every input field {list(PADDING)}, got {sorted(values)}")
        host = self.stage()
        for name, value in values.items():
            field = getattr(host, name)
            field[:n] = value
            field[n:size] = PADDING[name]
        end = self.buffer.numel() - (self.rows - size) * self.max_blocks * 4  # through block table row `size`
        self.buffer[:end].copy_(self.host_buffers[self.turn][:end], non_blocking=True)
        if self.device.type == "cuda":
            event = self.copied[self.turn] = torch.cuda.Event()
            event.record()
        self.turn, self.copies = 1 - self.turn, self.copies + 1


def astuple(views: InputViews) -> tuple:
    return tuple(getattr(views, f.name) for f in fields(views))
