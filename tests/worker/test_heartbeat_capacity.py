"""The heartbeat reports the capacity the engine was built with, never the worker setting that asked for it."""
from __future__ import annotations

import pytest

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.protocol import Keys
from kvgate.worker.heartbeat import engine_capacity
from kvgate.worker.settings import WorkerSettings
from kvgate.worker.worker import Worker


def beat_of(redis_server, engine) -> dict[bytes, bytes]:
    settings = WorkerSettings(redis_url=redis_server.url, namespace="cap", worker_id="w-cap", max_num_seqs=32,
                              sim_num_blocks=64)
    worker = Worker(engine, settings)
    worker._beat()
    return redis_server.client().hgetall(Keys("cap").worker("w-cap"))


def test_heartbeat_carries_the_real_engines_max_num_seqs_and_blocks_not_the_settings(redis_server):
    from kvgate.engine import LLMEngine
    from tests.engine.helpers import BLOCK_BYTES, tiny_source

    # built differently from what the settings say (32 sequences, 64 blocks)
    engine = LLMEngine(tiny_source("llama", seed=3)[0], max_num_seqs=3, kv_cache_memory=10 * BLOCK_BYTES,
                       max_model_len=64)
    beat = beat_of(redis_server, engine)
    assert beat[b"max_num_seqs"] == b"3" and beat[b"total_blocks"] == b"10"


def test_heartbeat_carries_the_simulated_engines_capacity(redis_server):
    beat = beat_of(redis_server, SimulatedEngine(100, 16, 7, 0.0, 0.0, 0))
    assert beat[b"max_num_seqs"] == b"7" and beat[b"total_blocks"] == b"100"


def test_an_engine_without_a_capacity_is_refused_rather_than_guessed():
    with pytest.raises(AttributeError):
        engine_capacity(object())
