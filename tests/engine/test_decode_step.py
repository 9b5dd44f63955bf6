"""The pure-decode step's post-processing (`LLMEngine._step_decode`) hands out exactly what the general path
does, step by step: stop ids, EOS, max_tokens, logprobs, streamed text and sampled rows included."""
from __future__ import annotations

from kvgate.engine import LLMEngine, SamplingParams
from tests.engine.helpers import BLOCK_BYTES, random_prompts, tiny_source
from tests.engine.test_llm_engine import ByteTokenizer

REQUESTS = [
    (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), False),
    (SamplingParams(temperature=0, max_tokens=30), True),
    (SamplingParams(temperature=0.8, max_tokens=40, seed=3, stop_token_ids=list(range(0, 97, 9))), False),
    (SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True), False),
    (SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), False),
    (SamplingParams(temperature=1.0, max_tokens=25, seed=11, ignore_eos=True), True),
    (SamplingParams(temperature=0, max_tokens=35, stop_token_ids=[7, 8, 9, 10, 11, 12]), False),
    (SamplingParams(temperature=0.5, max_tokens=33, seed=5, logprobs=0, ignore_eos=True), True),
]


def run(general_only: bool) -> tuple[list[list], int]:
    source, _ = tiny_source("llama", seed=8)
    source.tokenizer = ByteTokenizer()
    engine = LLMEngine(source, kv_cache_memory=64 * BLOCK_BYTES, max_num_seqs=4, max_model_len=128)
    fast_steps = []
    step_decode = engine._step_decode
    engine._step_decode = lambda *a: fast_steps.append(1) or step_decode(*a)
    if general_only:
        engine.scheduler._decode_all = lambda: None  # plain (sequence, 1) lists: the general post-processing
    for i, (prompt, (params, stream)) in enumerate(zip(random_prompts(len(REQUESTS), 3, 20, seed=8), REQUESTS)):
        engine.add_request(str(i), prompt, params, stream_text=stream)
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
    return steps, len(fast_steps)


def test_decode_fast_path_outputs_equal_the_general_path_step_by_step():
    fast, fast_steps = run(general_only=False)
    general, general_fast_steps = run(general_only=True)
    assert fast_steps > 20 and general_fast_steps == 0
    assert fast == general
    finished = {o.request_id: o for step in fast for o in step if o.finished}
    assert len(finished) == len(REQUESTS)
    assert {o.finish_reason for o in finished.values()} == {"stop", "length"}
