"""Detokenization off the engine thread gives the text the engine gives inline: the same increments, the same
final text and ids, stop strings cut at the same token, incomplete characters held until complete."""
from __future__ import annotations

import random

import pytest

from kvgate.engine import LLMEngine, SamplingParams
from kvgate.engine.detokenizer import Detokenizer, batch_decoder
from kvgate.engine.detokenizer_thread import DetokenizerThread
from tests.engine.helpers import BLOCK_BYTES, tiny_source
from tests.engine.test_llm_engine import E_ACUTE, ByteTokenizer


@pytest.fixture(scope="module")
def source():
    src, _ = tiny_source("llama", seed=6)
    src.tokenizer = ByteTokenizer()
    return src


def make_engine(source) -> LLMEngine:
    return LLMEngine(source, kv_cache_memory=64 * BLOCK_BYTES, max_num_seqs=4, max_model_len=128)


def inline(source, requests) -> dict:
    """What the engine streams and finishes with when it decodes the text itself."""
    engine, got = make_engine(source), {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for o in engine.step():
            text, _ = got.get(o.request_id, ("", None))
            got[o.request_id] = (text + o.new_text, (o.text, o.token_ids, o.finish_reason) if o.finished else None)
    return got


def threaded(source, requests) -> dict:
    """The same requests with detokenize=False and a DetokenizerThread, aborting on its stop strings."""
    engine, detok, got = make_engine(source), DetokenizerThread(source.tokenizer), {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params, detokenize=False)
        detok.add(rid, params.stop, incremental=True)

    def collect(lag):
        for step in detok.results(lag):
            for d in step.deltas:
                text, _ = got.get(d.request_id, ("", None))
                out = step.outputs.get(d.request_id)
                reason = "stop" if d.stopped else out and out.finish_reason
                got[d.request_id] = (text + d.text, (d.output_text, d.output_ids, reason) if d.finished else None)
                if d.stopped:
                    engine.abort(d.request_id)
    try:
        while engine.has_unfinished():
            detok.submit(engine.step(), 0.0)
            collect(lag=1)  # the engine runs a step ahead of the text, as in the worker
        collect(lag=0)
    finally:
        detok.close()
    return got


def test_threaded_text_equals_the_engines_own_text_with_stop_strings_and_broken_characters(source):
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 90) for _ in range(5)] for _ in range(6)]
    free = inline(source, [(str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                           for i, p in enumerate(prompts)])
    requests = []
    for i, prompt in enumerate(prompts):
        text = free[str(i)][1][0]
        stops = [text[9:12], "never-appears"] if i % 2 else None
        requests.append((str(i), prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stops)))
    expected, got = inline(source, requests), threaded(source, requests)
    assert got == expected
    assert sum(f[2] == "stop" for _, f in expected.values()) == 3  # the stop strings cut the odd ones
    assert any("\ufffd" in f[0] for _, f in expected.values())  # and ids outside UTF-8 were decoded


def test_a_character_split_across_tokens_comes_out_whole_when_its_last_byte_arrives():
    detok = Detokenizer(ByteTokenizer())
    detok.add("r")
    pieces = [detok.step([("r", [t], i == 3)])[0].text for i, t in enumerate((33, *E_ACUTE, 34))]
    assert pieces == ["A", "", "é", "B"]


def test_ids_past_a_stop_string_are_dropped_and_the_text_cut_where_it_starts():
    detok = Detokenizer(ByteTokenizer())
    detok.add("r", stops=["CD"])
    ids = ByteTokenizer().encode("ABCDEF")
    first = detok.step([("r", ids[:1], False)])  # "A" may not start "CD": out at once
    rest = detok.step([("r", ids[1:], False)])  # several ids at once, as a lagging detokenizer sees them
    assert [(d.text, d.token_ids) for d in first + rest] == [("A", ids[:1]), ("B", ids[1:2]), ("", ids[2:3]),
                                                             ("", ids[3:4])]  # "C" held back, then cut
    end = rest[-1]
    assert end.finished and end.stopped and end.output_text == "AB" and end.output_ids == ids[:4]
    assert detok.step([("r", ids[4:], True)]) == []  # later ids of a stopped request are ignored


def test_text_not_read_before_the_end_is_decoded_once_at_the_end():
    detok = Detokenizer(ByteTokenizer())
    detok.add("r", incremental=False)
    ids = ByteTokenizer().encode("hello")
    deltas = [d for i in range(5) for d in detok.step([("r", ids[i:i + 1], i == 4)])]
    assert [(d.text, d.finished) for d in deltas] == [("", False), ("hello", True)]  # first ids (timing), the end
    assert deltas[-1].output_text == "hello" and deltas[-1].output_ids == ids


def test_batch_decoding_equals_decoding_each_window_with_the_real_tokenizer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    rng = random.Random(0)
    specials = sorted(tok.all_special_ids)
    windows = [[rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tok.vocab_size)
                for _ in range(rng.randrange(0, 6))] for _ in range(500)]
    assert batch_decoder(tok)(windows) == [tok.decode(w, skip_special_tokens=True) for w in windows]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from kvgate.engine.loader import resolve_model
    try:
        return resolve_model("smollm2-135m").tokenizer
    except Exception as e:  # the bundled model package is optional
        pytest.skip(f"bundled SmolLM2 tokenizer unavailable: {e}")
