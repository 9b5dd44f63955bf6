"""The worker decodes text off its engine thread (engine.detokenizer_thread): what a job streams and its final
result must still be exactly what the engine gives when it decodes inline, stop strings, characters split
across tokens and cancellation included. A tiny random Llama with a byte tokenizer keeps it fast."""
from __future__ import annotations

import random
import time

import pytest

from kvgate.engine import LLMEngine, SamplingParams
from kvgate.producer.protocol import Delta
from tests.engine.helpers import BLOCK_BYTES, tiny_source
from tests.engine.test_llm_engine import ByteTokenizer
from tests.support import wait_for


@pytest.fixture(scope="module")
def source():
    src, _ = tiny_source("llama", seed=6)
    src.tokenizer = ByteTokenizer()
    return src


def make_engine(source, step_s: float = 0.0) -> LLMEngine:
    engine = LLMEngine(source, kv_cache_memory=128 * BLOCK_BYTES, max_num_seqs=4, max_model_len=256)
    if step_s:  # a slower step, so a cancel lands mid-generation
        run = engine.runner.run
        engine.runner.run = lambda batch: (time.sleep(step_s), run(batch))[1]
    return engine


def inline(source, prompt: str, params: SamplingParams):
    engine = make_engine(source)
    engine.add_request("r", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out


def streamed(queue, job_id: str) -> tuple[str, list[int]]:
    deltas = [e for e in queue.events() if isinstance(e, Delta) and e.job_id == job_id]
    assert [d.index for d in deltas] == list(range(len(deltas)))
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]


def test_streams_and_results_equal_the_engines_inline_text_with_stop_strings(queue, thread_worker, source):
    rng = random.Random(5)
    prompts = ["".join(chr(rng.randrange(97, 123)) for _ in range(8)) for _ in range(6)]
    free = [inline(source, p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)).text for p in prompts]
    stops = [[t[12:15], "never"] if i % 2 else [] for i, t in enumerate(free)]
    expected = [inline(source, p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=s or None))
                for p, s in zip(prompts, stops)]
    with thread_worker(engine=make_engine(source)):
        ids = [queue.submit(p, max_tokens=40, temperature=0, ignore_eos=True, stop=s, stream=i < 4)
               for i, (p, s) in enumerate(zip(prompts, stops))]
        finals = {f.job_id: f for f in queue.wait_finals(len(ids))}
    for i, (job_id, want) in enumerate(zip(ids, expected)):
        final = finals[job_id]
        assert (final.status, final.finish_reason, final.text, final.token_ids) == \
            ("done", want.finish_reason, want.text, want.token_ids)
        assert final.usage.completion_tokens == len(final.token_ids)
        if i < 4:  # streamed: the deltas rebuild the result, ids past a stop string included nowhere
            assert streamed(queue, job_id) == (final.text, final.token_ids)
    assert sum(finals[j].finish_reason == "stop" for j in ids) == 3
    assert any("\ufffd" in finals[j].text for j in ids)  # ids outside UTF-8 went through the same path


def test_a_cancelled_stream_ends_with_the_text_it_streamed(queue, thread_worker, source):
    with thread_worker(engine=make_engine(source, step_s=0.01), cancel_poll_ms=50):
        job_id = queue.submit("abcdefgh", max_tokens=240, temperature=0, ignore_eos=True, stream=True)
        wait_for(lambda: len(queue.events()) >= 3, 30, "three deltas")
        queue.cancel(job_id)
        final = queue.wait_finals(1)[0]
    assert final.status == "cancelled" and final.finish_reason == "abort" and len(final.token_ids) < 240
    assert streamed(queue, job_id) == (final.text, final.token_ids)
