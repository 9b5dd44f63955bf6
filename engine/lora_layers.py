"""The model's LoRA: each target projection wrapped to add its row's adapter delta (kernels.ops.lora_apply), the
device slots' weights, and the step's rows grouped by adapter slot (kernels/lora_rows.py).

`LoraModel.attach` wraps a built model's q/k/v (fused qkv_proj: three slices), o_proj, gate/up (fused gate_up_proj:
two slices) and down_proj in every layer, leaving models/llama.py's forward as it is: the wrapper is called where
the projection was. Each wrapper holds `a` [max_loras, slices x max_rank, in] and per slice `b` [max_loras,
max_rank, out_slice]: an adapter of lower rank, or one not targeting a slice, leaves zeros there, which add nothing.
A step with no adapter row (`rows` None) runs the projections alone, as without LoRA."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvgate.engine.lora import TARGETS, LoraAdapter, ModelShapes, read_adapter
from kvgate.kernels import ops
from kvgate.kernels.lora_rows import LoraRows

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
OWNER = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


@dataclass(slots=True)
class StepRows:
    """The step's rows grouped by adapter slot (built once per step), shared by every wrapper; None: no adapter row."""
    rows: LoraRows | None = None


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, widths: list[int], in_features: int, max_loras: int, max_rank: int,
                 step: StepRows, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.step = base, step
        self.a = torch.zeros(max_loras, len(widths) * max_rank, in_features, dtype=dtype, device=device)
        self.bs = [torch.zeros(max_loras, max_rank, w, dtype=dtype, device=device) for w in widths]
        self.offsets = [sum(widths[:i]) for i in range(len(widths))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.step.rows
        return y if rows is None else ops.lora_apply(y, x, self.a, self.bs, self.offsets, rows)

    def load(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot `slot` takes one (A, scaled B) per slice, None for a slice the adapter leaves alone."""
        max_rank = self.bs[0].shape[1]
        self.a[slot].zero_()
        for i, (b, pair) in enumerate(zip(self.bs, pairs)):
            b[slot].zero_()
            if pair is not None:
                a_i, b_i = pair
                rank = a_i.shape[0]
                self.a[slot, i * max_rank:i * max_rank + rank].copy_(a_i)
                b[slot, :rank].copy_(b_i.T)


class LoraModel:
    """The wrapped projections of one model and the facts adapters are checked against."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, names: tuple[str, ...]) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.shapes = ModelShapes.of(model.config, names)
        self.step = StepRows()
        weight = model.model.embed_tokens.weight
        self.layers: list[dict[str, LoraLinear]] = []
        for layer in model.model.layers:
            wrapped = {}
            for fused, parts in FUSED.items():
                owner = getattr(layer, OWNER[fused])
                widths = [self.shapes.modules[p][1] for p in parts]
                in_features = self.shapes.modules[parts[0]][0]
                wrapped[fused] = LoraLinear(getattr(owner, fused), widths, in_features, max_loras, max_rank,
                                            self.step, weight.dtype, weight.device)
                setattr(owner, fused, wrapped[fused])
            self.layers.append(wrapped)

    def read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at `path`, checked against this model (LoraError when it does not fit)."""
        return read_adapter(name, path, self.shapes, self.max_rank)

    @torch.inference_mode()
    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy the adapter into device slot `slot`, overwriting whatever it held (between steps)."""
        for index, wrapped in enumerate(self.layers):
            for fused, parts in FUSED.items():
                wrapped[fused].load(slot, [adapter.weights.get((index, p)) for p in parts])

    def set_rows(self, batch) -> bool:
        """Per-row slots of a scheduled batch [(sequence, n new tokens)]; True when any row has an adapter."""
        slots = [seq.lora_slot for seq, _ in batch]
        if max(slots, default=-1) < 0:
            self.step.rows = None
            return False
        rows = [slot for slot, (_, n) in zip(slots, batch) for _ in range(n)]
        self.step.rows = LoraRows.of(rows, self.layers[0]["o_proj"].a.device)
        return True


assert set(TARGETS) == {p for parts in FUSED.values() for p in parts}  # one list of target modules, two views
