"""The simulated engine's adapters: slots, loads with their cost, a missing folder refused naming the file."""
from __future__ import annotations

import pytest

from kvgate.engine.lora import LoraError
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.simulated import SimulatedEngine
from tests.support import simulated_adapter



def _run(engine):
    while engine.has_unfinished():
        engine.step()


def test_the_simulated_engine_serves_adapters_in_slots_counting_loads_and_evictions(tmp_path):
    engine = SimulatedEngine(256, max_num_seqs=4, step_overhead_s=0, per_token_s=0, sleep=False, max_loras=1,
                             lora_load_s=0.5)
    for name in ("a", "b"):
        engine.loras.add(name, simulated_adapter(tmp_path, name))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("r1", [1, 2, 3], params, lora="a")
    engine.add_request("r2", [1, 2, 3], params, lora="b")
    engine.add_request("r3", [1, 2, 3], params)
    _run(engine)
    assert engine.loras.loads == 2 and engine.loras.evictions == 1  # one slot: b waited for a, then took its slot
    assert engine.runner.lora.load_busy_s == 1.0


def test_a_simulated_adapter_without_its_config_is_refused_naming_the_file(tmp_path):
    engine = SimulatedEngine(64, sleep=False, max_loras=2)
    with pytest.raises(LoraError, match="adapter_config.json is missing"):
        engine.loras.add("x", str(tmp_path / "nowhere"))
    assert "x" not in engine.loras


def test_without_slots_the_simulated_engine_serves_no_adapters(tmp_path):
    with pytest.raises(LoraError, match="max_loras >= 1"):
        SimulatedEngine(64, sleep=False).loras.add("a", simulated_adapter(tmp_path, "a"))
