"""The worker-facing LLMEngine: rejections, incremental text and stop handling, abort, admission, stats."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvgate.engine import LLMEngine, RequestRejected, SamplingParams
from kvgate.engine.llm_engine import detokenize_increment, held_back
from kvgate.engine.sequence import Sequence
from tests.engine.helpers import BLOCK_BYTES, tiny_source

E_ACUTE = (95, 96)  # the two UTF-8 bytes of "é"


class ByteTokenizer:
    """Token t < 95 is the ASCII character 32 + t; 95 and 96 are the halves of 'é'."""
    eos_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b - 32 for b in text.encode("ascii")]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        raw = bytes({95: 0xC3, 96: 0xA9}.get(t, t + 32) for t in ids)
        return raw.decode("utf-8", errors="replace")

    def get_vocab(self) -> dict[str, int]:
        return {chr(32 + t): t for t in range(95)}  # no fill-in-the-middle tokens


@pytest.fixture(scope="module")
def source():
    src, _ = tiny_source("llama", seed=6)
    src.tokenizer = ByteTokenizer()
    return src


@pytest.fixture
def engine(source):
    return LLMEngine(source, kv_cache_memory=64 * BLOCK_BYTES, max_num_seqs=4, max_model_len=128)


def drain(engine: LLMEngine) -> dict:
    outs: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.parametrize("prompt, params, reason", [
    ([], SamplingParams(), "empty"),
    ("", SamplingParams(), "empty"),
    ([1] * 129, SamplingParams(), "max_model_len"),
    ([1, 2, 97], SamplingParams(), "outside the vocabulary"),
    ([1, -1], SamplingParams(), "outside the vocabulary"),
])
def test_bad_prompts_are_rejected_with_the_reason(engine, prompt, params, reason):
    with pytest.raises(RequestRejected, match=reason):
        engine.add_request("r", prompt, params)
    assert not engine.has_unfinished()


def test_request_needing_more_than_the_whole_cache_is_rejected(source):
    small = LLMEngine(source, kv_cache_memory=4 * BLOCK_BYTES, max_model_len=128)  # 4 blocks = 64 tokens
    with pytest.raises(RequestRejected, match="whole cache has 4"):
        small.add_request("r", [1] * 40, SamplingParams(max_tokens=40))
    assert small.add_request("ok", [1] * 40, SamplingParams(max_tokens=24)) == 40


def test_text_prompt_without_tokenizer_and_duplicate_ids_are_rejected(source, engine):
    bare = LLMEngine(tiny_source("llama", seed=6)[0], kv_cache_memory=1 << 20)
    with pytest.raises(RequestRejected, match="no tokenizer"):
        bare.add_request("r", "hello", SamplingParams())
    engine.add_request("dup", [1, 2], SamplingParams())
    with pytest.raises(RequestRejected, match="dup"):
        engine.add_request("dup", [3], SamplingParams())
    assert isinstance(RequestRejected("x"), ValueError)


def test_max_tokens_is_clipped_to_max_model_len(engine):
    engine.add_request("r", [1] * 120, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    last = drain(engine)["r"][-1]
    assert last.finish_reason == "length" and last.output_tokens == 8


def test_streamed_text_adds_up_to_the_final_text_and_never_shows_a_stop_string(engine):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request("free", "hello world", greedy)
    full = drain(engine)["free"][-1].text
    stop = full[7:10]
    engine.add_request("stopped", "hello world", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                 stop=[stop, "never-appears"]))
    outs = drain(engine)["stopped"]
    streamed = "".join(o.new_text for o in outs)
    assert outs[-1].finish_reason == "stop" and outs[-1].finished
    assert streamed == outs[-1].text == full[:full.index(stop)]
    assert all(o.text is None for o in outs[:-1]) and outs[-1].token_ids is not None


def test_stop_token_id_finishes_with_the_token_included(engine):
    engine.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    ids = drain(engine)["free"][-1].token_ids
    engine.add_request("stop", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[3]]))
    last = drain(engine)["stop"][-1]
    assert last.finish_reason == "stop" and last.token_ids == ids[:ids.index(ids[3]) + 1]


def test_incomplete_utf8_character_is_held_until_its_last_byte():
    seq = Sequence("r", [33], SamplingParams(), max_tokens=8)
    tok = ByteTokenizer()
    pieces = []
    for t in (33, E_ACUTE[0], E_ACUTE[1], 34):
        seq.token_ids.append(t)
        pieces.append(detokenize_increment(tok, seq))
    assert pieces == ["A", "", "é", "B"]


def test_text_that_may_start_a_stop_string_is_held_back():
    assert held_back("say <en", ["<end>"]) == 3
    assert held_back("say <e", ["<end>", "e"]) == 2
    assert held_back("say", ["<end>"]) == 0


def test_abort_frees_blocks_at_once_and_returns_the_partial_output(engine):
    total = engine.stats.total_blocks
    engine.add_request("a", [1] * 30, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", [2] * 30, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort" and len(out.token_ids) == 3 and out.text is not None
    assert engine.abort("a") is None and engine.abort("unknown") is None
    engine.abort("b")
    assert not engine.has_unfinished() and engine.stats.free_blocks == total


def test_admission_counts_free_tokens_minus_the_reserve_for_growth(engine):
    idle = engine.admission()
    assert idle.free_seqs == 4 and idle.admissible_tokens == engine.stats.total_blocks * 16 and idle.block_size == 16
    engine.add_request("a", [1] * 20, SamplingParams(max_tokens=60))
    busy = engine.admission()
    assert busy.free_seqs == 3
    assert busy.admissible_tokens <= idle.admissible_tokens - 20 - int(engine.reserve_ratio * 60)
    assert engine.fits(20, 10) and not engine.fits(500, 10) and not engine.fits(0, 10)


def test_fits_takes_anything_the_cache_can_hold_when_idle(source):
    small = LLMEngine(source, kv_cache_memory=4 * BLOCK_BYTES, max_model_len=128)
    assert small.fits(40, 24) and not small.fits(40, 40)


def test_stats_count_steps_tokens_and_prefix_hits(engine):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(40)), params)
    drain(engine)
    engine.add_request("b", list(range(40)), params)
    drain(engine)
    s = engine.stats
    assert s.prefix_hit_tokens == 32 and s.prefix_query_tokens == 80 and s.generation_tokens == 6
    assert s.steps >= 6 and s.running == s.waiting == 0 and s.kv_usage == 0.0


def test_importing_engine_does_not_import_torch():
    code = ("import sys, kvgate.engine; from kvgate.engine import SamplingParams, RequestRejected, StepOutput, "
            "Admission, EngineStats; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reserve_ratio_rises_after_a_preemption_and_decays_while_none_happen(source):
    tight = LLMEngine(source, kv_cache_memory=6 * BLOCK_BYTES, max_num_seqs=8, max_model_len=128)
    start = tight.reserve_ratio
    for i in range(6):
        tight.add_request(str(i), [i + 1] * 20, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    peak = start
    while tight.has_unfinished():
        tight.step()
        peak = max(peak, tight.reserve_ratio)
    assert tight.stats.preemptions > 0 and peak > start
    before = tight.reserve_ratio
    tight.add_request("calm", [1, 2], SamplingParams(max_tokens=5, ignore_eos=True))
    drain(tight)
    assert tight.reserve_ratio < before


def test_prompt_tokens_count_each_prompt_token_once_despite_chunking_and_preemption(source):
    tight = LLMEngine(source, kv_cache_memory=6 * BLOCK_BYTES, max_num_seqs=8, max_model_len=128,
                      max_num_batched_tokens=8, enable_prefix_caching=False)
    prompts = [[i + 1] * (20 + i) for i in range(6)]
    for i, prompt in enumerate(prompts):
        tight.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    drain(tight)
    assert tight.stats.preemptions > 0
    assert tight.stats.prompt_tokens == sum(map(len, prompts))


def test_generate_with_one_bad_prompt_raises_and_leaves_nothing_queued(source):
    from kvgate.engine import LLM
    llm = LLM(source, kv_cache_memory=1 << 20, max_model_len=64)
    with pytest.raises(RequestRejected, match="max_model_len=64"):
        llm.generate([[1, 2, 3], [4] * 65], SamplingParams(), use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.stats.free_blocks == llm.engine.stats.total_blocks


def test_an_engine_raises_the_young_gc_threshold_so_collections_do_not_run_every_step():
    import gc

    from kvgate.engine.cost_model_runner import CostModelRunner
    from kvgate.engine.llm_engine import GC_GEN0_THRESHOLD
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        LLMEngine(runner=CostModelRunner(8, sleep=False))
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, 10, 10)
    finally:
        gc.set_threshold(*before)


def test_output_budget_is_max_tokens_cut_at_max_model_len_and_add_request_applies_it(source):
    small = LLMEngine(source, kv_cache_memory=64 * BLOCK_BYTES, max_model_len=128)
    assert small.output_budget(100, 10) == 10
    assert small.output_budget(100, 1_000_000) == 28
    assert small.output_budget(128, 5) == 0
    small.add_request("a", [1] * 100, SamplingParams(max_tokens=1_000_000))
    assert small.scheduler.waiting[0].max_tokens == 28
