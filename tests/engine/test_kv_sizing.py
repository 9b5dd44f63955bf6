"""KV cache sizing: explicit bytes, the CPU default, the GPU budget after a profiling forward, and clear refusals."""
from __future__ import annotations

import logging

import pytest
import torch

from kvgate.engine import LLMEngine
from kvgate.engine.model_runner import GiB, kv_budget
from tests.engine.helpers import BLOCK_BYTES, tiny_source


@pytest.fixture(scope="module")
def source():
    return tiny_source("llama", seed=3)[0]


def test_gpu_budget_is_our_share_less_what_is_in_use_and_the_activation_peak():
    assert kv_budget(total=80 * GiB, free=70 * GiB, activation_peak=2 * GiB, utilization=0.9) == 60 * GiB
    # another process taking 20 GiB more leaves 20 GiB less
    assert kv_budget(total=80 * GiB, free=50 * GiB, activation_peak=2 * GiB, utilization=0.9) == 40 * GiB
    # already over our share: nothing, never a negative size
    assert kv_budget(total=80 * GiB, free=5 * GiB, activation_peak=2 * GiB, utilization=0.5) == 0


def test_explicit_bytes_give_whole_blocks_and_the_size_is_logged(source, caplog):
    with caplog.at_level(logging.INFO, logger="kvgate.engine.model_runner"):
        engine = LLMEngine(source, kv_cache_memory=10 * BLOCK_BYTES + BLOCK_BYTES // 2, max_model_len=64)
    assert engine.stats.total_blocks == 10
    assert "KV cache of 10 blocks x 16 = 160 tokens" in caplog.text


def test_cpu_default_holds_every_running_sequence_at_full_length(source):
    engine = LLMEngine(source, device="cpu", max_num_seqs=3, max_model_len=40)
    assert engine.stats.total_blocks == 3 * 3  # 40 tokens take 3 blocks of 16


def test_a_cache_too_small_for_one_block_is_refused_with_what_to_raise(source):
    with pytest.raises(ValueError, match="room for 0 blocks of 8192 bytes: raise kv_cache_memory"):
        LLMEngine(source, kv_cache_memory=BLOCK_BYTES - 1)


@pytest.mark.gpu
def test_gpu_cache_fills_the_share_left_by_weights_and_activations(source):
    total = torch.cuda.mem_get_info()[1]
    engine = LLMEngine(source, device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    cache_bytes = engine.stats.total_blocks * BLOCK_BYTES
    assert cache_bytes > 0.2 * total  # a tiny model leaves almost all of its share to the cache
    assert torch.cuda.memory_allocated() <= 0.3 * total
