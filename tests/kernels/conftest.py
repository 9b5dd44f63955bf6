"""Kernel test helpers. Without a GPU the Triton kernels run in the interpreter on CPU tensors; with one,
the same tests run compiled on CUDA tensors (and the `gpu` tests add bf16/fp16 sweeps)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Triton reads TRITON_INTERPRET when it decorates its own library functions, i.e. at its first import.
INTERPRETER_READY = HAS_CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from kvgate.bench.triton_interpreter import squeeze_scalar_index

    squeeze_scalar_index()  # Triton 3.6's interpreter with numpy >= 2.5 (the GPU image's pair): see there


def pytest_collection_modifyitems(config, items):
    if INTERPRETER_READY:
        return
    reason = "triton was imported before TRITON_INTERPRET=1 could be set: run TRITON_INTERPRET=1 pytest tests/kernels"
    for item in items:
        if "tests/kernels" in str(item.fspath) and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
