"""CPU GEMMs through oneDNN, with each weight reordered once into oneDNN's blocked layout.

PyTorch sends a float32 `F.linear` on CPU to MKL's sgemm, known to give non-Intel processors (this project's
CI VMs are AMD EPYCs) slower code paths. oneDNN chooses its kernels from the CPU's own features, and a
prepacked weight is not repacked on every call. On W-CPU's shapes at 32 rows this is 1.3-2.7x faster per GEMM
(`python -m kvgate.bench.cpu_linear`), and a 32-sequence decode step's GEMMs take 53 ms instead of 95."""
from __future__ import annotations

import torch
from torch import nn


def onednn_linear_available() -> bool:
    """The two ops are private to torch: a build without them keeps `F.linear` rather than failing to load."""
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_linear_available()


class PackedLinear(nn.Module):
    """`y = x @ weight.T + bias` with the weight held only in oneDNN's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # the hint picks the blocking; any number of rows is still computed right
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, rows_hint: int) -> int:
    """Replace every float32 CPU `nn.Linear` in `model` by a `PackedLinear`; returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and can_pack(module.weight)]
    for name, module in targets:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, PackedLinear(module.weight, module.bias, rows_hint))
    return len(targets)
