"""The simulated engine is the production LLMEngine over a CostModelRunner: same Scheduler, BlockManager,
prefix cache and admission; only the model's compute is replaced by a cost model."""
from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
import zlib

import pytest

from kvgate.engine import LLMEngine, SamplingParams
from kvgate.engine.block_manager import BlockManager
from kvgate.engine.cost_model_runner import CostModelRunner
from kvgate.engine.llm_engine import RESERVE_RATIO_DECAY, RESERVE_RATIO_START
from kvgate.engine.scheduler import Scheduler
from kvgate.engine.simulated import SimulatedEngine
from tests.engine.helpers import BLOCK_BYTES, tiny_source


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_the_simulated_engine_runs_the_production_scheduler_block_manager_and_engine_code():
    engine = SimulatedEngine(64, sleep=False)
    assert isinstance(engine, LLMEngine)
    assert type(engine.scheduler) is Scheduler and type(engine.block_manager) is BlockManager
    assert type(engine.runner) is CostModelRunner
    defined = [name for name, value in vars(SimulatedEngine).items() if callable(value) or isinstance(value, property)]
    assert defined == ["__init__"], "SimulatedEngine overrides nothing of LLMEngine"


def test_an_engine_serves_either_a_model_or_a_runner():
    runner = CostModelRunner(8, sleep=False)
    for args, kwargs in (((), {}), (("random:llama-3.2-1b",), {"runner": runner})):
        with pytest.raises(ValueError, match="either a model to load or a runner"):
            LLMEngine(*args, **kwargs)
    assert LLMEngine(runner=runner).block_manager.num_blocks == 8


def test_prefix_cache_hits_cost_nothing_in_the_cost_model():
    engine = SimulatedEngine(64, step_overhead_s=0.001, per_token_s=0.01, sleep=False)
    runner = engine.runner
    prompt = list(range(1, 101))  # 100 tokens: 6 full blocks can be served from the cache, 4 tokens cannot

    def one_request(request_id: str) -> tuple[int, float]:
        tokens, busy = runner.tokens_computed, runner.busy_s
        engine.add_request(request_id, prompt, greedy(2))
        run_all(engine)
        return runner.tokens_computed - tokens, runner.busy_s - busy

    cold_tokens, cold_s = one_request("cold")
    warm_tokens, warm_s = one_request("warm")
    assert cold_tokens == 100 + 1  # the prompt, then one decode
    assert warm_tokens == 4 + 1 and engine.stats.prefix_hit_tokens == 96
    assert math.isclose(cold_s - warm_s, 96 * 0.01)  # same two steps, 96 tokens fewer


def test_blocks_running_out_preempt_by_recompute_and_the_outputs_stay_the_same():
    def engine() -> SimulatedEngine:  # 4 blocks of 16: one request of 16 + 40 tokens fills the whole cache
        return SimulatedEngine(4, 16, max_num_seqs=4, sleep=False)

    alone = {}
    for rid in ("a", "b"):
        solo = engine()
        solo.add_request(rid, [7 if rid == "a" else 8] * 16, greedy(40))
        alone.update(run_all(solo))
    tight = engine()
    for rid in ("a", "b"):
        tight.add_request(rid, [7 if rid == "a" else 8] * 16, greedy(40))
    together = run_all(tight)
    assert tight.stats.preemptions >= 1
    assert together == alone and all(len(t) == 40 for t in together.values())
    assert tight.runner.tokens_computed > 2 * (16 + 39)  # the preempted sequence computed some tokens twice


def test_admission_follows_the_production_formula():
    engine = SimulatedEngine(64, 16, max_num_seqs=4, sleep=False)
    engine.add_request("r", [5] * 20, greedy(60))
    waiting = engine.admission()  # no blocks yet: the whole context and half the output are reserved
    assert (waiting.free_seqs, waiting.admissible_tokens) == (3, 64 * 16 - (20 + math.ceil(0.5 * 60)))
    engine.step()  # prefill: 2 blocks hold the 21 tokens; 59 to go at the decayed ratio
    ratio = RESERVE_RATIO_START * RESERVE_RATIO_DECAY
    assert engine.reserve_ratio == ratio
    running = engine.admission()
    assert (running.free_seqs, running.admissible_tokens) == (3, 62 * 16 - math.ceil(ratio * 59))
    assert engine.fits(100, 200) == (100 + math.ceil(ratio * 200) <= running.admissible_tokens)
    assert not engine.fits(running.admissible_tokens, 2)


def test_admission_does_not_count_a_prefix_that_running_sequences_hold():
    engine = SimulatedEngine(16, 16, max_num_seqs=4, sleep=False)
    prefix = list(range(1, 161))  # 10 full blocks
    engine.add_request("first", prefix + [7] * 8, greedy(8))
    engine.step()  # prefilled: its 10 prefix blocks are held and cached
    same, other = prefix + [9] * 8, list(range(200, 368))
    assert engine.shared_prefix_tokens(same) == 160 and engine.shared_prefix_tokens(other) == 0
    assert engine.fits(len(same), 8, engine.shared_prefix_tokens(same))  # needs 1 block of the 5 left
    assert not engine.fits(len(other), 8, engine.shared_prefix_tokens(other))  # needs 11
    before = engine.admission().admissible_tokens
    engine.add_request("second", same, greedy(8))  # waiting: only its own tail is reserved, not the held prefix
    assert before - engine.admission().admissible_tokens == 8 + math.ceil(engine.reserve_ratio * 8)
    engine.step()
    assert engine.stats.free_blocks == 16 - 11 - 1 and engine.stats.preemptions == 0
    engine.abort("first"), engine.abort("second")
    assert engine.shared_prefix_tokens(same) == 0  # cached but held by nobody: reviving it takes free blocks


def test_the_simulated_and_the_real_engine_schedule_and_admit_identically_step_by_step():
    source, _ = tiny_source("llama", seed=3)
    real = LLMEngine(source, kv_cache_memory=6 * BLOCK_BYTES, max_num_seqs=8, max_model_len=128)
    sim = SimulatedEngine(real.block_manager.num_blocks, 16, 8, max_model_len=real.max_model_len, vocab_size=97,
                          sleep=False)
    for engine in (real, sim):
        for i in range(6):
            engine.add_request(str(i), [i + 1] * 20, greedy(40))
    trace = {id(real): [], id(sim): []}
    while real.has_unfinished() or sim.has_unfinished():
        for engine in (real, sim):
            finished = sorted(o.request_id for o in engine.step() if o.finished)
            trace[id(engine)].append((engine.admission(), engine.stats, engine.reserve_ratio, finished))
    assert real.stats.preemptions > 0
    assert trace[id(real)] == trace[id(sim)]


def test_tokens_are_a_function_of_seed_request_position_and_prompt():
    def tokens(seed: int, rid: str = "r", prompt: str = "a b c", params: SamplingParams | None = None) -> list[int]:
        engine = SimulatedEngine(64, seed=seed, sleep=False)
        engine.add_request(rid, prompt, params or greedy(8))
        return run_all(engine)[rid]

    assert tokens(0) == tokens(0) and len(set(tokens(0))) > 1
    assert tokens(0) != tokens(1) and tokens(0) != tokens(0, rid="s") and tokens(0) != tokens(0, prompt="a b d")
    assert tokens(0, rid="x", params=SamplingParams(seed=9, max_tokens=8)) == \
        tokens(0, rid="y", params=SamplingParams(seed=9, max_tokens=8))


def test_building_and_stepping_a_simulated_engine_never_imports_torch():
    code = """
import sys
import zlib
from kvgate.engine import SamplingParams
from kvgate.engine.simulated import SimulatedEngine
engine = SimulatedEngine(32, sleep=False)
engine.add_request("r", "a prompt of a few words", SamplingParams(max_tokens=4, stop=["never"]))
engine.add_request("c", engine.encode_chat([{"role": "user", "content": "hi"}]), SamplingParams(max_tokens=3))
outs = [o for _ in range(10) for o in engine.step()]
assert {o.request_id for o in outs if o.finished} == {"r", "c"}, outs
import kvgate.engine.llm_engine, kvgate.engine.scheduler, kvgate.engine.block_manager, kvgate.engine.sequence
import kvgate.engine.cost_model_runner
assert "torch" not in sys.modules, "torch imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True)


RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                         "kind": {"enum": ["cat", "dog"]}}}


def test_a_json_schema_job_on_the_simulated_engine_completes_with_output_that_follows_the_schema():
    """Issue 45. Before: every constrained job answered "Only fast tokenizers are supported" (the simulated tokenizer
    was no tokenizer the grammar engine could read). Its tokenizer is a real fast one now, and its cost model draws
    only what the grammar allows, as a masked sampler does, so fleet tests and benchmarks can run constrained jobs."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    engine = SimulatedEngine(64, sleep=False)
    schema = {"kind": "json_schema", "spec": json.dumps(RECORD)}
    for i in range(4):
        engine.add_request(f"r{i}", f"record {i}", SamplingParams(max_tokens=80, seed=i, structured=schema))
    engine.add_request("date", "when", SamplingParams(max_tokens=20, structured={
        "kind": "regex", "spec": "20[0-9]{2}-(0[1-9]|1[0-2])"}))
    engine.add_request("free", "a b c", greedy(5))
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    for i in range(4):
        out = done[f"r{i}"]
        assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
        jsonschema.validate(json.loads(out.text), RECORD)
    assert len({done[f"r{i}"].text for i in range(4)}) > 1  # a function of the seed, as unconstrained tokens are
    assert done["date"].finish_reason == "stop" and re.fullmatch("20[0-9]{2}-(0[1-9]|1[0-2])", done["date"].text)
    assert done["free"].finish_reason == "length" and done["free"].text == "".join(
        f" t{t}" for t in done["free"].token_ids)  # unconstrained output is what it always was


def test_the_plain_simulated_tokenizer_decodes_every_id_as_the_fast_one_does():
    """The torch-free install's simulated workers use the plain twin; the same ids must read as the same text."""
    pytest.importorskip("transformers")
    from kvgate.engine.simulated_fast_tokenizer import FastSimulatedTokenizer
    from kvgate.engine.simulated_tokenizer import SimulatedTokenizer

    fast, plain = FastSimulatedTokenizer(1000), SimulatedTokenizer(1000)
    assert len(fast) == len(plain) and fast.eos_token_id == plain.eos_token_id
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(plain)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == plain.decode(ids, skip_special_tokens=skip), ids
    text = 'x{"é": [1, 2]}'
    assert plain.decode(fast(text, add_special_tokens=False)["input_ids"]) == text  # any text has real tokens
    assert fast.encode("a b c") == plain.encode("a b c") == [zlib.crc32(w) % 1000 for w in (b"a", b"b", b"c")]


def test_without_transformers_the_simulated_engine_serves_with_the_plain_tokenizer():
    """The torch-free install (kvgate[gateway]) runs simulated workers in its tests (make test-pythons): they must
    still serve, and a structured job there is an error naming what is missing. Nothing on the simulated engine's
    import path may need the real engine's packages (the overlap rule's import of the sampler's numpy rows once
    stopped every such worker)."""
    code = """
import sys
for name in ("transformers", "numpy", "torch", "tokenizers", "triton"):
    sys.modules[name] = None  # as if not installed
from kvgate.engine import SamplingParams
from kvgate.engine.simulated import SimulatedEngine
from kvgate.engine.simulated_tokenizer import SimulatedTokenizer
engine = SimulatedEngine(32, sleep=False)
assert type(engine.tokenizer) is SimulatedTokenizer
engine.add_request("r", "a prompt", SamplingParams(max_tokens=3))
engine.add_request("s", "a prompt", SamplingParams(max_tokens=3, structured={"kind": "regex", "spec": "[a-z]+"}))
done = {}
while engine.has_unfinished():
    done |= {o.request_id: o for o in engine.step() if o.finished}
assert done["r"].finish_reason == "length" and done["r"].text.startswith(" t"), done["r"]
assert done["s"].finish_reason == "error" and "transformers" in done["s"].error, done["s"]
# the same constraint again, its compile known to have failed: answered the same way, not refused by add_request
# (which one a request got hung on whether the compile thread had failed before add_request looked)
engine.add_request("s2", "a prompt", SamplingParams(max_tokens=3, structured={"kind": "regex", "spec": "[a-z]+"}))
while engine.has_unfinished():
    done |= {o.request_id: o for o in engine.step() if o.finished}
assert done["s2"].finish_reason == "error" and done["s2"].error == done["s"].error, done["s2"]
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stdout[-1000:], run.stderr[-3000:])

