"""The inputs of a decode-only step, built from persistent host arrays instead of Python lists.

Each sequence owns a row of a numpy block table for as long as it decodes; a step writes only the blocks
appended since the last one (usually none), and a row is rewritten whole when its sequence's table changed
under it (`Sequence.table_version`: preemption frees the table). Everything a step needs is packed into one
byte array, its int64 fields then its int32 ones, so a device gets it in one (pinned, non-blocking) host-to-device
copy and views each field in its own dtype: no cast kernel per step. On the CPU the arrays are the tensors."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvgate.engine.sampling_rows import SamplingBatch, SamplingRows
from kvgate.engine.sequence import Sequence


@dataclass(slots=True)
class DecodeBatch:
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, width] int32, -1 past each sequence's blocks
    rows: torch.Tensor  # [B] int64: each sequence's row, where a step launched ahead keeps its tokens (`keep`)


class DecodeInputs:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, device: torch.device) -> None:
        self.block_size, self.device = block_size, device
        self.capacity = 2 * max_num_seqs  # rows of sequences not seen lately are reused past this
        self.max_blocks = max_blocks_per_seq
        self.tables = np.full((self.capacity, max_blocks_per_seq), -1, dtype=np.int32)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.seq_of_row = [-1] * self.capacity
        self.synced = np.zeros(self.capacity, dtype=np.int64)  # table entries already written
        self.version = np.full(self.capacity, -1, dtype=np.int64)
        self.last_step = np.full(self.capacity, -1, dtype=np.int64)
        self.free_rows = list(range(self.capacity - 1, -1, -1))
        self.sampling = SamplingRows(self.capacity)
        self.rows = self.positions = np.zeros(0, dtype=np.int64)  # the last build's, for its sampling batch
        self.step = 0
        self.pinned = device.type == "cuda"
        self.one_copy = device.type != "cpu"  # pack and copy once; on the CPU the arrays are used as they are
        self.device_rows: torch.Tensor | None = None  # the last build's rows, on the device
        self.last_tokens: torch.Tensor | None = None  # [capacity] int64: each row's token sampled ahead (`keep`)

    def build(self, seqs: list[Sequence], width: int | None = None) -> DecodeBatch:
        """Inputs for one new token per sequence (the last of each); `width` fixes the block-table width (a CUDA
        graph's), else it is the widest table in the batch."""
        self.step += 1
        n = len(seqs)
        rows = self._rows(seqs)
        ids = np.array([seq.token_ids[-1] for seq in seqs], dtype=np.int64)
        positions = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
        width = width or int(self.synced[rows].max())
        self.rows, self.positions = rows, positions
        bs = self.block_size
        tables = self.tables[rows, :width]
        slots = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        cu = np.arange(n + 1, dtype=np.int32)
        context_lens = (positions + 1).astype(np.int32)
        if not self.one_copy:  # the arrays themselves, no copy and no conversion
            batch = DecodeBatch(*map(torch.from_numpy, (ids, positions, slots, cu, context_lens, tables, rows)))
        else:
            wide = np.concatenate([ids, positions, slots, rows])
            flat = self._to_device(np.concatenate([wide.view(np.uint8), cu.view(np.uint8), context_lens.view(np.uint8),
                                                   np.ascontiguousarray(tables).reshape(-1).view(np.uint8)]))
            ids_t, positions_t, slots_t, rows_t = torch.split(flat[:wide.nbytes].view(torch.int64), n)
            cu_t, context_t, tables_t = torch.split(flat[wide.nbytes:].view(torch.int32), [n + 1, n, n * width])
            batch = DecodeBatch(ids_t, positions_t, slots_t, cu_t, context_t, tables_t.view(n, width), rows_t)
        self.device_rows = batch.rows
        return batch

    def fed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The last build's input ids with each one still on the device taken from there: a sequence whose last
        token was sampled by the step launched just before (engine/overlap.py) has a negative id on the host."""
        if self.last_tokens is None:
            return input_ids
        return torch.where(input_ids < 0, self.last_tokens[self.device_rows], input_ids)

    def keep(self, tokens: torch.Tensor) -> None:
        """The last build's sampled tokens [B], kept on the device in their rows for the next step's `fed`."""
        if self.last_tokens is None:
            self.last_tokens = torch.zeros(self.capacity, dtype=torch.long, device=self.device)
        self.last_tokens[self.device_rows] = tokens.to(self.device, torch.long)

    def sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The sampling parameters of the last build's sequences, `seqs`, gathered from their rows."""
        return self.sampling.gather(self.rows, self.positions, seqs)

    def _rows(self, seqs: list[Sequence]) -> np.ndarray:
        """Each sequence's row, its table brought up to date: one vectorized comparison finds the few rows that
        are new, stale (the table was freed since) or short of blocks appended since the last step."""
        get = self.row_of.get
        rows = np.array([get(seq.seq_id, -1) for seq in seqs], dtype=np.int64)
        versions = np.array([seq.table_version for seq in seqs], dtype=np.int64)
        lengths = np.array([len(seq.block_table) for seq in seqs], dtype=np.int64)
        known = rows >= 0
        lagging = ~known | (self.version[rows] != versions) | (self.synced[rows] != lengths)
        self.last_step[rows[known]] = self.step  # so that a claim below never evicts a row of this batch
        for i in np.flatnonzero(lagging).tolist():
            seq, row = seqs[i], int(rows[i])
            if not known[i]:
                row = rows[i] = self._claim(seq)
                self.last_step[row] = self.step  # claimed rows of this step are not evicted by the next claim
            same_table = known[i] and self.version[row] == seq.table_version
            self._write(row, seq, int(self.synced[row]) if same_table else 0)
        return rows

    def _to_device(self, packed: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(packed)
        if self.pinned:
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _write(self, row: int, seq: Sequence, start: int) -> None:
        table = seq.block_table
        if len(table) > self.max_blocks:
            raise ValueError(f"sequence {seq.request_id} holds {len(table)} blocks, more than the "
                             f"{self.max_blocks} a row of max_model_len has")
        if start == 0:
            self.tables[row, len(table):] = -1
        self.tables[row, start:len(table)] = table[start:]
        self.synced[row], self.version[row] = len(table), seq.table_version

    def _claim(self, seq: Sequence) -> int:
        if not self.free_rows:
            self._evict()
        row = self.free_rows.pop()
        self.row_of[seq.seq_id], self.seq_of_row[row] = row, seq.seq_id
        self.sampling.write(row, seq)
        return row

    def _evict(self) -> None:
        """Free the rows of every sequence not seen in this step (finished, preempted or waiting ones)."""
        for row in np.flatnonzero(self.last_step < self.step).tolist():
            self.row_of.pop(self.seq_of_row[row], None)
            self.sampling.clear(row)
            self.seq_of_row[row], self.last_step[row] = -1, -1
            self.free_rows.append(row)
        if not self.free_rows:
            raise RuntimeError(f"more than {self.capacity} sequences in one decode step")
