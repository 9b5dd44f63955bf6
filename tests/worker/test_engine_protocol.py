"""The worker uses an engine only through `kvgate.worker.engine.Engine`: every engine it is given offers each
name that protocol declares (the production engine, the simulated one built on it, and so any subclass). An
engine without a tokenizer is test_worker_ids_only's."""
from __future__ import annotations

from kvgate.engine.simulated import SimulatedEngine
from kvgate.worker.engine import Engine


def protocol_names() -> set[str]:
    names = set(getattr(Engine, "__annotations__", {}))
    return names | {n for n, v in vars(Engine).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}


def test_the_simulated_engine_offers_everything_the_worker_uses_of_an_engine():
    engine = SimulatedEngine(num_blocks=64, block_size=16, max_num_seqs=4, sleep=False)
    names = protocol_names()
    assert {"model_name", "tokenizer", "block_size", "max_model_len", "max_num_seqs", "stats", "admission", "step",
            "add_request", "abort", "fits", "shared_prefix_tokens", "encode_chat", "has_unfinished"} <= names
    missing = sorted(n for n in names if not hasattr(engine, n))
    assert missing == [], f"the simulated engine lacks {missing}"
