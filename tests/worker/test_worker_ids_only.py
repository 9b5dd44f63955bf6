"""An engine without a tokenizer (a `random:` model, a test double) goes through the same path as one with:
`IdsOnly` stands where the detokenizer thread would, so its jobs stream ids, end with exactly one final whose
ids the deltas rebuild, carry their logprobs, and can be cancelled mid-flight."""
from __future__ import annotations

import pytest

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.protocol import Delta
from tests.support import wait_for


def tokenizerless(step_s: float = 0.0) -> SimulatedEngine:
    engine = SimulatedEngine(num_blocks=256, block_size=16, max_num_seqs=4, step_overhead_s=step_s, per_token_s=0.0,
                             sleep=step_s > 0)
    engine.tokenizer = None  # what an engine over a model without a tokenizer has
    return engine


def deltas_of(queue, job_id: str) -> list[Delta]:
    deltas = [e for e in queue.events() if isinstance(e, Delta) and e.job_id == job_id]
    assert [d.index for d in deltas] == list(range(len(deltas)))
    return deltas


@pytest.mark.parametrize("stream", [True, False])
def test_a_job_of_an_engine_without_a_tokenizer_gets_its_ids_and_one_final(queue, thread_worker, stream):
    with thread_worker(engine=tokenizerless()):
        job_id = queue.submit(prompt_token_ids=list(range(1, 40)), max_tokens=24, ignore_eos=True, stream=stream,
                              logprobs=0)
        final = queue.wait_finals(1)[0]
    assert (final.job_id, final.status, final.finish_reason, final.text) == (job_id, "done", "length", "")
    assert len(final.token_ids) == final.usage.completion_tokens == 24 and final.usage.prompt_tokens == 39
    assert [t.id for t in final.logprobs] == final.token_ids
    deltas = deltas_of(queue, job_id)
    if stream:
        assert [t for d in deltas for t in d.token_ids] == final.token_ids and all(d.text == "" for d in deltas)
        assert [t.id for d in deltas for t in d.logprobs] == final.token_ids
    else:
        assert deltas == []
    assert final.timings.first_token is not None and final.timings.admitted <= final.timings.first_token


def test_a_cancelled_job_of_an_engine_without_a_tokenizer_ends_with_the_ids_it_streamed(queue, thread_worker):
    with thread_worker(engine=tokenizerless(step_s=0.01), cancel_poll_ms=50):
        job_id = queue.submit(prompt_token_ids=[5, 6, 7, 8], max_tokens=2000, ignore_eos=True, stream=True)
        wait_for(lambda: len(queue.events()) >= 3, 30, "three deltas")
        queue.cancel(job_id)
        finals = queue.wait_finals(1)
    final = finals[0]
    assert final.status == "cancelled" and final.finish_reason == "abort" and 0 < len(final.token_ids) < 2000
    assert [t for d in deltas_of(queue, job_id) for t in d.token_ids] == final.token_ids
    assert final.usage.completion_tokens == len(final.token_ids)


def test_stop_strings_on_an_engine_without_a_tokenizer_are_an_error_result(queue, thread_worker):
    with thread_worker(engine=tokenizerless()):
        queue.submit(prompt_token_ids=[1, 2, 3], max_tokens=4, stop=["x"])
        final = queue.wait_finals(1)[0]
    assert final.status == "error" and "need a tokenizer" in final.error
