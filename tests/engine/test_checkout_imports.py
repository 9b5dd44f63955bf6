"""A checkout's root holds kernels/ (kvgate.kernels), and transformers >= 5.25 imports Hugging Face's `kernels` by
that bare name: run from the root (`python -m ...`, pytest, the tests' worker processes), the folder stood in for it
and every model load failed with "cannot import name 'CUDAProperties' from 'kernels'"."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from tests.support import ROOT

PROBE = """
import kvgate.engine, kernels, transformers
from transformers import LlamaConfig  # loads transformers' hub-kernels integration, which imports `kernels`
print(kernels.__file__)
"""


def test_transformers_loads_from_the_checkout_root_with_hugging_faces_kernels_not_ours():
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed (transformers < 5.25 does not need it): nothing shadows")
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = done.stdout.strip().splitlines()[-1]
    assert not found.startswith(str(ROOT / "kernels")), f"`kernels` resolved to the checkout's folder: {found}"
