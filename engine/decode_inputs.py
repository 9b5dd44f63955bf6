"""The inputs of a decode-only step, built from persistent host arrays instead of Python lists.

Each sequence owns a row of a numpy block table for as long as it decodes; a step writes only the blocks
appended since the last one (usually none), and a row is rewritten whole when its sequence's table changed
under it (`Sequence.table_version`: preemption frees the table). Everything a step needs is packed into one
byte array, its int64 fields then its int32 ones, so a device gets it in one (pinned, non-blocking) host-to-device
copy and views each field in its own dtype: no cast kernel per step. On the CPU the arrays are the tensors. A step a
decode graph replays is written instead into the graph's static inputs (engine/graph_inputs.py), padding included.

Under overlap (engine/overlap.py) a sequence's last token may still be on the device, sampled by the step before
into `tokens` (in that step's row order): its row's `prev` says which row of that step holds it, and the graph (or
`fed`, for an eager step) takes it from there. A step launched ahead writes its own tokens into `tokens` (the
graph's argmax, or the sampler's output): nothing copies them afterwards."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvgate.engine.graph_inputs import StaticInputs
from kvgate.engine.models import AttentionMetadata
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
    prev: torch.Tensor  # [B] int64: the row of the step before whose token (on the device) is the input; -1: none
    bucket: int | None = None  # the decode graph whose static inputs these are views of; None: an eager step

    @property
    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping, self.block_tables, self.cu_seqlens_q, self.context_lens)


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
        self.index = np.full(self.capacity, -1, dtype=np.int64)  # each row's index in the last build; -1: not in it
        self.tokens = torch.zeros(max_num_seqs, dtype=torch.long, device=device)  # a launched step's, in its order

    def build(self, seqs: list[Sequence], graph: StaticInputs | None = None, bucket: int | None = None
              ) -> DecodeBatch:
        """Inputs for one new token per sequence (the last of each). With `graph`, written into a decode graph's
        static inputs for its bucket of `bucket` rows (the block tables at its full width) and the batch is their
        views; else the block tables are as wide as the widest in the batch."""
        self.step += 1
        n = len(seqs)
        rows = self._rows(seqs)
        ids = np.array([seq.token_ids[-1] for seq in seqs], dtype=np.int64)
        positions = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
        prev = self._prev(rows, ids)
        self.rows, self.positions = rows, positions
        bs = self.block_size
        tables = self.tables[rows] if graph is not None else self.tables[rows, :int(self.synced[rows].max())]
        slots = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        context_lens = (positions + 1).astype(np.int32)
        if graph is not None:
            graph.write(n, bucket, input_ids=ids, positions=positions, slot_mapping=slots, prev=prev,
                        context_lens=context_lens, block_tables=tables)
            v = graph.views
            return DecodeBatch(v.input_ids[:n], v.positions[:n], v.slot_mapping[:n], graph.cu_seqlens_q[:n + 1],
                               v.context_lens[:n], v.block_tables[:n], v.prev[:n], bucket)
        cu = np.arange(n + 1, dtype=np.int32)
        width = tables.shape[1]
        if not self.one_copy:  # the arrays themselves, no copy and no conversion
            return DecodeBatch(*map(torch.from_numpy, (ids, positions, slots, cu, context_lens, tables, prev)))
        wide = np.concatenate([ids, positions, slots, prev])
        flat = self._to_device(np.concatenate([wide.view(np.uint8), cu.view(np.uint8), context_lens.view(np.uint8),
                                               np.ascontiguousarray(tables).reshape(-1).view(np.uint8)]))
        ids_t, positions_t, slots_t, prev_t = torch.split(flat[:wide.nbytes].view(torch.int64), n)
        cu_t, context_t, tables_t = torch.split(flat[wide.nbytes:].view(torch.int32), [n + 1, n, n * width])
        return DecodeBatch(ids_t, positions_t, slots_t, cu_t, context_t, tables_t.view(n, width), prev_t)

    def fed(self, batch: DecodeBatch) -> torch.Tensor:
        """An eager step's input ids with each one still on the device taken from there (what a decode graph does
        inside itself): a sequence whose last token the step launched just before sampled (engine/overlap.py)."""
        return torch.where(batch.prev < 0, batch.input_ids, self.tokens[batch.prev])

    def _prev(self, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Each row's index in the last build where its last token is still on the device (negative on the
        host), else -1; then this build's indices replace the last one's."""
        on_device = ids < 0
        prev = np.where(on_device, self.index[rows], -1)
        if (prev[on_device] < 0).any():
            raise RuntimeError("a decode step has a token still on the device for a sequence that was not in the "
                               "step before: a step launched ahead was not the last one built")
        self.index[self.rows] = -1
        self.index[rows] = np.arange(len(rows))
        return prev

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
