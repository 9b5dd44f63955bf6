"""Overlapped steps (issue 41, engine/overlap.py): a decode step launched before the previous one's tokens are read
writes the same tokens, texts and counts as the plain step (greedy, seeded, preempted, stop strings, stop ids,
max_tokens, structured output and jump-forward, logprobs), a stopped sequence's extra token is never emitted or
counted and its blocks are freed, and the previous step is read while the next one is outstanding."""
from __future__ import annotations

import pytest

from kvgate.engine import LLMEngine, SamplingParams
from kvgate.engine.cost_model_runner import CostModelRunner
from kvgate.engine.overlap import PENDING
from tests.engine.helpers import BLOCK_BYTES, random_prompts, tiny_source, vocab_source
from tests.engine.test_llm_engine import ByteTokenizer


@pytest.fixture(scope="module")
def tiny_with_vocab():
    from kvgate.engine.loader import resolve_model
    return vocab_source(resolve_model("smollm2-135m").tokenizer)


@pytest.fixture(scope="module")
def source():
    src, _ = tiny_source("llama", seed=6)
    src.tokenizer = ByteTokenizer()
    return src


def generate(source, requests: list[tuple[object, SamplingParams]], overlap: str, **config) -> dict:
    """Every request to its end: per request its final output and everything streamed; the engine's stats."""
    engine = LLMEngine(source, overlap=overlap, **{"device": "cpu", "kv_cache_memory": 64 * BLOCK_BYTES,
                                                     "max_num_seqs": 4, **config})
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    launched_ids, launch = set(), engine.runner.launch  # the requests in steps launched ahead
    engine.runner.launch = lambda batch: launched_ids.update(s.request_id for s in batch.seqs) or launch(batch)
    final, streamed, texts = {}, {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            assert PENDING not in out.new_token_ids and out.request_id not in final
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            if out.finished:
                final[out.request_id] = (out.token_ids, out.text, out.finish_reason, out.output_tokens, out.logprobs)
    for rid, (ids, text, *_) in final.items():
        assert streamed[rid] == ids and texts[rid] == text, rid  # what was streamed is the output, nothing more
    ahead = engine.overlap.launched if engine.overlap else 0
    return {"final": final, "generated": engine.stats.generation_tokens, "ahead": ahead,
            "preemptions": engine.stats.preemptions, "free": engine.stats.free_blocks == engine.stats.total_blocks,
            "launched_ids": launched_ids}


def assert_same(plain: dict, ahead: dict) -> None:
    assert ahead["final"] == plain["final"]
    assert ahead["generated"] == plain["generated"] == sum(f[3] for f in plain["final"].values())
    assert plain["ahead"] == 0 and ahead["ahead"] > 0  # the overlapped run did launch steps ahead
    assert plain["free"] and ahead["free"]


def mixed_requests(temperature: float, n: int = 10) -> list[tuple[list[int], SamplingParams]]:
    return [(p, SamplingParams(temperature=temperature, seed=i, max_tokens=6 + 3 * i, ignore_eos=True))
            for i, p in enumerate(random_prompts(n, 3, 30, seed=1))]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_greedy_and_seeded_tokens_are_the_same_with_overlap_on_and_off(source, temperature):
    requests = mixed_requests(temperature)
    assert_same(generate(source, requests, "off"), generate(source, requests, "on"))


def test_a_small_cache_preempts_and_the_tokens_are_still_the_same(source):
    requests = mixed_requests(0.8)
    roomy = generate(source, requests, "off")
    tight = generate(source, requests, "on", kv_cache_memory=10 * BLOCK_BYTES, max_num_seqs=6, block_size=16)
    assert tight["preemptions"] > 0
    assert_same(roomy, tight)


def test_stop_strings_stop_ids_and_max_tokens_end_the_same_with_overlap(source):
    free = generate(source, [("hello world", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))], "off")
    ids, text = free["final"]["0"][:2]
    stop_string, stop_id = text[7:10], ids[4]
    requests = [("hello world", SamplingParams(temperature=0, max_tokens=24, stop=[stop_string])),
                ("hello world", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])),
                ("hello world", SamplingParams(temperature=0, max_tokens=5)),
                ("a longer prompt that keeps going", SamplingParams(temperature=0.7, seed=3, max_tokens=30))]
    plain, ahead = generate(source, requests, "off"), generate(source, requests, "on")
    assert [plain["final"][str(i)][2] for i in range(4)] == ["stop", "stop", "length", "length"]
    assert plain["final"]["0"][1] == text[:7] and plain["final"]["1"][0] == ids[:ids.index(stop_id) + 1]
    assert_same(plain, ahead)


def test_eos_ends_a_request_the_same_with_overlap(source):
    free = generate(source, [([5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))], "off")
    eos = free["final"]["0"][0][5]
    source.config.eos_token_id = eos  # the model's own EOS is one it writes early
    try:
        requests = [([5, 6, 7], SamplingParams(temperature=0, max_tokens=12)), ([8, 9], SamplingParams(max_tokens=9))]
        plain, ahead = generate(source, requests, "off"), generate(source, requests, "on")
    finally:
        source.config.eos_token_id = None
    assert plain["final"]["0"][0][-1] == eos and plain["final"]["0"][2] == "stop"
    assert_same(plain, ahead)


@pytest.mark.parametrize("jump_forward", [True, False])
def test_structured_output_and_jump_forward_are_sync_points_and_write_the_same(tiny_with_vocab, jump_forward):
    """A structured request's mask needs its last token on the host: no step is launched ahead while one runs; the
    plain requests beside it go on ahead once it has finished. Answers, forced tokens included, are the same."""
    pytest.importorskip("llguidance")
    from tests.engine.test_structured import PERSON, structured  # jsonschema: not on a bare GPU image
    schema = structured("json_schema", PERSON)
    requests = [("Record 1:", SamplingParams(temperature=0, max_tokens=60, structured=schema)),
                ("Record 2:", SamplingParams(temperature=0.8, seed=4, max_tokens=60, structured=schema)),
                ("Once upon a time", SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)),
                ("The weather", SamplingParams(temperature=0.8, seed=5, max_tokens=80, stop=["e t"]))]
    config = dict(kv_cache_memory=1 << 22, jump_forward=jump_forward)
    plain = generate(tiny_with_vocab, requests, "off", **config)
    ahead = generate(tiny_with_vocab, requests, "on", **config)
    assert {plain["final"][rid][2] for rid in "01"} == {"stop"} and not ahead["launched_ids"] & {"0", "1"}
    assert_same(plain, ahead)


def test_logprobs_and_penalties_are_sync_points_whose_outputs_are_the_same(source):
    """A request with logprobs or a penalty needs its last token on the host: while one runs, no step is launched
    ahead; once it has finished, the others' steps are."""
    requests = [([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, logprobs=2)),
                ([4, 5, 6], SamplingParams(temperature=0.9, seed=1, max_tokens=5, repetition_penalty=1.3)),
                ([7, 8, 9], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))]
    plain, ahead = generate(source, requests, "off"), generate(source, requests, "on")
    assert ahead["final"]["0"][4] is not None and ahead["launched_ids"] == {"2"}
    assert_same(plain, ahead)


def test_a_stopped_sequence_is_found_a_step_late_and_its_extra_token_is_never_emitted_or_counted(source):
    engine = LLMEngine(source, overlap="on", device="cpu", kv_cache_memory=64 * BLOCK_BYTES, max_num_seqs=4)
    engine.add_request("short", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("long", [4, 5, 6], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    short = engine.seqs["short"]
    launched = []
    launch = engine.runner.launch
    engine.runner.launch = lambda batch: launched.append([s.request_id for s in batch.seqs]) or launch(batch)
    outputs = []
    while not any(o.finished for o in outputs):
        outputs = engine.step()
    final = next(o for o in outputs if o.finished)
    # its third token was read while the step computing its (fourth) extra token was already launched
    assert final.request_id == "short" and final.output_tokens == 3 and len(final.token_ids) == 3
    assert launched[-1] == ["short", "long"] and short.is_finished and not short.block_table
    assert engine.stats.generation_tokens == 3 + len(engine.seqs["long"].output_token_ids) - 1  # long's is pending
    assert engine.seqs["long"].token_ids[-1] == PENDING
    rest = [o for _ in range(3) for o in engine.step()]
    assert rest and all(o.request_id == "long" for o in rest) and launched[-1] == ["long"]


def test_the_previous_step_is_read_while_the_next_one_is_outstanding(source):
    """The mechanism, untimed: step N + 1 is launched before step N's tokens are asked for, every time."""
    engine = LLMEngine(source, overlap="on", device="cpu", kv_cache_memory=64 * BLOCK_BYTES, max_num_seqs=4)
    for i in range(3):
        engine.add_request(str(i), [i + 1] * 5, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    events, launch = [], engine.runner.launch

    def recording_launch(batch):
        step = launch(batch)
        k = len([e for e in events if e[0] == "launch"])
        events.append(("launch", k))
        tokens = step.tokens
        step.tokens = lambda: events.append(("read", k)) or tokens()
        return step

    engine.runner.launch = recording_launch
    while engine.has_unfinished():
        engine.step()
    reads = [k for kind, k in events if kind == "read"]
    assert len(reads) >= 9 and reads == sorted(reads)
    for k in reads:  # launch k + 1 came before read k
        assert events.index(("launch", k + 1)) < events.index(("read", k))


def test_an_abort_drops_the_token_still_on_the_device(source):
    engine = LLMEngine(source, overlap="on", device="cpu", kv_cache_memory=64 * BLOCK_BYTES, max_num_seqs=4)
    engine.add_request("a", [1] * 30, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", [2] * 30, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    emitted = [t for _ in range(4) for o in engine.step() if o.request_id == "a" for t in o.new_token_ids]
    assert engine.seqs["a"].token_ids[-1] == PENDING
    out = engine.abort("a")
    assert out.finish_reason == "abort" and out.token_ids == emitted and PENDING not in out.token_ids
    later = [o for _ in range(3) for o in engine.step()]
    assert later and all(o.request_id == "b" for o in later)
    engine.abort("b")
    assert not engine.has_unfinished() and engine.stats.free_blocks == engine.stats.total_blocks


def test_a_request_made_room_for_while_a_step_is_outstanding_changes_no_tokens(source):
    requests = mixed_requests(0.0, n=3)
    plain = generate(source, requests, "off")
    engine = LLMEngine(source, overlap="on", device="cpu", kv_cache_memory=64 * BLOCK_BYTES, max_num_seqs=3)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    final = {}
    for k in range(200):
        if k == 6:  # a step is outstanding: "0" steps aside with its last token still on the device
            assert engine.seqs["0"].token_ids[-1] == PENDING
            assert engine.make_room(4, 4, 0, ["0"]) == ["0"]
            engine.add_request("new", [3, 3, 3, 3], SamplingParams(temperature=0, max_tokens=4), ahead=True)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
        if not engine.has_unfinished():
            break
    assert {rid: final[rid] for rid in plain["final"]} == {rid: f[0] for rid, f in plain["final"].items()}
    assert engine.stats.stepped_aside == 1


def test_auto_is_off_on_a_cpu_and_on_needs_a_runner_that_launches_ahead(source):
    engine = LLMEngine(source, device="cpu", kv_cache_memory=64 * BLOCK_BYTES)
    assert engine.overlap is None and engine.runner.launch_device == "cpu"  # a str, not a method: CUDA's is "cuda"
    with pytest.raises(ValueError, match="overlap='on' needs a runner"):
        LLMEngine(runner=CostModelRunner(64, sleep=False), overlap="on")
    assert LLMEngine(runner=CostModelRunner(64, sleep=False)).overlap is None


def sampling_mix() -> list[tuple[list[int], SamplingParams]]:
    """Greedy, seeded and top-k/top-p rows in one batch, ending by max_tokens or a stop id."""
    return [(p, SamplingParams(temperature=(0.0, 0.8, 1.1)[i % 3], top_k=(-1, -1, 20)[i % 3], top_p=0.9, seed=i,
                               max_tokens=3 + 5 * i, stop_token_ids=[7]))
            for i, p in enumerate(random_prompts(13, 2, 90, seed=8))]


def test_greedy_temperature_and_top_k_top_p_rows_in_one_batch_write_the_same(source):
    config = dict(kv_cache_memory=1 << 22, max_num_seqs=13)
    assert_same(generate(source, sampling_mix(), "off", **config), generate(source, sampling_mix(), "on", **config))


@pytest.mark.gpu
def test_on_cuda_auto_overlaps_and_writes_the_plain_steps_tokens():
    """The device half of the mechanism: tokens fed from the GPU into the next graph's inputs, a non-blocking copy
    to the host read a step later; greedy, seeded and top-k/top-p rows (their host arrays copied without
    blocking), and max_tokens and stop ids ending sequences a step late."""
    source, _ = tiny_source("qwen3", seed=8)
    config = dict(device="cuda", dtype="bfloat16", kv_cache_memory=1 << 24, max_num_seqs=13)
    assert_same(generate(source, sampling_mix(), "off", **config), generate(source, sampling_mix(), "auto", **config))
