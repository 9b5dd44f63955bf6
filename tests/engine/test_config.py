"""EngineConfig: one declaration of the engine's settings, with sizes in units and clear refusals."""
from __future__ import annotations

import pytest

from kvgate.engine import LLMEngine
from kvgate.engine.config import EngineConfig
from tests.engine.helpers import BLOCK_BYTES, tiny_source


@pytest.mark.parametrize("given, size", [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1 KiB", 1024),
                                         (4096, 4096), ("4096", 4096), (None, None)])
def test_kv_cache_memory_takes_units_or_bytes(given, size):
    assert EngineConfig(kv_cache_memory=given).kv_cache_memory == size


@pytest.mark.parametrize("kwargs, named", [
    (dict(kv_cache_memory="lots"), "kv_cache_memory"), (dict(kv_cache_memory=0), "positive size"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(scheduling="fast"), "'continuous' or 'static'"), (dict(dtype="half"), "dtype"),
    (dict(device="gpu"), "cuda:N"), (dict(max_model_len=0), "max_model_len"), (dict(max_num_seq=4), "max_num_seq"),
])
def test_bad_values_raise_a_value_error_naming_the_setting(kwargs, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(**kwargs)


def test_an_engine_built_with_a_size_in_units_gets_that_many_blocks():
    engine = LLMEngine(tiny_source("llama", seed=3)[0], kv_cache_memory=f"{10 * BLOCK_BYTES // 1024}KiB",
                       max_model_len=64)
    assert engine.stats.total_blocks == 10


def test_the_worker_uses_the_engine_defaults():
    from kvgate.worker.settings import WorkerSettings

    engine, worker = EngineConfig(), WorkerSettings()
    assert worker.engine_config() == engine
    assert worker.max_num_seqs == engine.max_num_seqs == 256
