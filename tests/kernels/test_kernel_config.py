"""Launch configs step down until they fit the GPU, and the fitted one is reused."""
from __future__ import annotations

import pytest
import torch
from triton.runtime.errors import OutOfResources

from kvgate.kernels import config as cfg


def test_a_config_too_big_for_shared_memory_steps_down_and_is_remembered(monkeypatch):
    monkeypatch.setattr(cfg, "_fitted", {})
    tried: list[cfg.AttentionConfig] = []

    def launch(c: cfg.AttentionConfig) -> None:
        tried.append(c)
        if c.num_stages > 1 or c.block_n > 32:
            raise OutOfResources(300_000, 232_448, "shared memory")

    start = cfg.AttentionConfig(128, 64, 8, 3)
    cfg.launch_fitted(("prefill", 128), start, launch)
    assert tried[-1] == cfg.AttentionConfig(128, 32, 8, 1)
    tried.clear()
    cfg.launch_fitted(("prefill", 128), start, launch)
    assert tried == [cfg.AttentionConfig(128, 32, 8, 1)]


def test_a_launch_that_never_fits_raises():
    def launch(c):
        raise OutOfResources(1, 0, "shared memory")

    with pytest.raises(OutOfResources):
        cfg.launch_fitted(("never",), cfg.AttentionConfig(32, 32, 4, 2), launch)


def test_cpu_tensors_get_small_interpreter_tiles():
    assert cfg.prefill_config(128, torch.float32, torch.device("cpu")).block_m == 16
    assert cfg.decode_config(64, torch.bfloat16, torch.device("cpu")).block_n == 16
