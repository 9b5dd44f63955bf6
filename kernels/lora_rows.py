"""One step's rows grouped by adapter slot (Punica/S-LoRA's segments), built once per step and read by every LoRA
layer of it: the Triton kernel (kernels/lora.py) takes `rows`, one slot per row; the CPU twin (reference.lora_apply)
takes the runs and the segments, so that it multiplies each row by its own adapter only and never touches a base row.

A run is RUN_ROWS or more consecutive rows of one slot (a prefill chunk): the twin multiplies the slice of x in place
and adds into the slice of y, so a run's rows are never copied. The other adapter rows (decode rows, one a sequence)
form the segments: one slot's rows, padded to the longest segment's `length` so that all of them go through one
batched matmul: `gather` [segments x length] lists the row of each position (a padding position repeats its
segment's first row) and `valid` [segments, length, 1] zeroes the padding's products (None when no segment is
padded). The segments are those of slots first..first + count - 1 when their slots are contiguous (the slot stacks are
then sliced, not copied; an unused slot inside the range is a segment of padding only), else of `index`'s slots."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# A run this long is cheaper as its own matmuls (1 + slices ops, no copy) than gathered into a padded segment and
# added back (W-LORA's prefill chunks: 16-128 rows; a decode row is a run of 1)
RUN_ROWS = 8


@dataclass(frozen=True, slots=True)
class LoraRows:
    rows: torch.Tensor  # [N] int32: the slot of each row, -1 for a base row
    gather: torch.Tensor  # [segments x length] int64: the row at each padded segment position
    valid: torch.Tensor | None  # [segments, length, 1] float32: 1 at a real row, 0 at padding; None: no padding
    length: int
    first: int  # the segments' slots: first..first + count - 1, or `index` when that is not None
    count: int
    index: torch.Tensor | None
    runs: tuple[tuple[int, int, int], ...] = ()  # (slot, start, end): rows start..end - 1, all of that slot

    @classmethod
    def of(cls, slots: list[int], device: torch.device | str = "cpu", run_rows: int = RUN_ROWS) -> LoraRows:
        """The runs and segments of a step whose row n has adapter slot `slots[n]` (-1: the base model)."""
        runs: list[tuple[int, int, int]] = []
        members: dict[int, list[int]] = {}
        start = 0
        for end in range(1, len(slots) + 1):
            if end < len(slots) and slots[end] == slots[start]:
                continue
            slot = slots[start]
            if slot >= 0 and end - start >= run_rows:
                runs.append((slot, start, end))
            elif slot >= 0:
                members.setdefault(slot, []).extend(range(start, end))
            start = end
        used = sorted(members)
        contiguous = not used or used[-1] - used[0] + 1 <= 2 * len(used)  # few empty slots in between: pad them
        segments = list(range(used[0], used[-1] + 1)) if used and contiguous else used
        length = max((len(m) for m in members.values()), default=0)
        gather: list[int] = []
        valid: list[float] = []
        for slot in segments:
            own = members.get(slot, [0])
            real = len(members.get(slot, ()))
            gather += own + [own[0]] * (length - len(own))
            valid += [1.0] * real + [0.0] * (length - real)
        padded = len(valid) > sum(valid)
        return cls(torch.tensor(slots, dtype=torch.int32).to(device), torch.tensor(gather, dtype=torch.long).to(device),
                   torch.tensor(valid).view(len(segments), length, 1).to(device) if padded else None, length,
                   segments[0] if contiguous and segments else 0, len(segments),
                   None if contiguous else torch.tensor(segments, dtype=torch.long).to(device), tuple(runs))

    def by_segment(self, stack: torch.Tensor) -> torch.Tensor:
        """A per-slot stack [slots, ...] cut to the segments' slots, in segment order (a view when contiguous)."""
        return stack[self.first:self.first + self.count] if self.index is None else stack.index_select(0, self.index)
