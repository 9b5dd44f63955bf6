"""Embedding jobs (task embed) in the worker: run by the engine as prefills beside generation, answered with one final
that carries the vector, their KV blocks free again once answered; a worker can serve a model for embeddings only,
or refuse them, and says so in the error result."""
from __future__ import annotations

import struct

import pytest

from kvgate.engine.simulated import SimulatedEngine
from kvgate.producer.protocol import Embedding
from kvgate.producer.result import floats


def simulated(**kw) -> SimulatedEngine:
    return SimulatedEngine(num_blocks=64, block_size=16, max_num_seqs=4, step_overhead_s=0.0, per_token_s=0.0,
                           sleep=False, **kw)


def test_embedding_jobs_run_beside_generation_and_give_back_their_blocks(queue, thread_worker):
    engine = simulated()
    with thread_worker(engine=engine):
        gen = queue.submit(prompt_token_ids=list(range(1, 30)), max_tokens=40, ignore_eos=True)
        long_ = queue.submit(prompt_token_ids=list(range(1, 300)), task="embed")
        cut = queue.submit(prompt_token_ids=[7, 8, 9], task="embed", embedding=Embedding("mean", True, 3))
        raw = queue.submit(prompt_token_ids=[7, 8, 9], task="embed", embedding=Embedding(normalize=False))
        finals = {f.job_id: f for f in queue.wait_finals(4)}
    assert all(f.status == "done" for f in finals.values()), [f.error for f in finals.values()]
    assert len(finals[gen].token_ids) == 40 and finals[gen].embedding is None
    vector = floats(finals[long_].embedding)
    assert len(vector) == engine.embedding_size and abs(sum(v * v for v in vector) - 1) < 1e-5
    assert finals[long_].usage.prompt_tokens == 299 and finals[long_].usage.completion_tokens == 0
    assert finals[long_].token_ids == [] and finals[long_].finish_reason == "stop"
    assert len(floats(finals[cut].embedding)) == 3
    assert len(finals[raw].embedding) == 4 * engine.embedding_size
    assert struct.unpack(f"<{engine.embedding_size}f", finals[raw].embedding) != tuple(vector)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks  # every block back, none cached


def test_an_embedding_the_cache_can_never_hold_is_an_error_result_naming_it(queue, thread_worker):
    with thread_worker(engine=simulated()):
        queue.submit(prompt_token_ids=list(range(1, 2000)), task="embed")
        final = queue.wait_finals(1)[0]
    assert final.status == "error" and "KV blocks but the whole cache has 64" in final.error


@pytest.mark.parametrize("embeddings, refused, why", [("only", {}, "served for embeddings only"),
                                                      ("off", {"task": "embed"}, "not served for embeddings")])
def test_a_worker_serving_embeddings_only_or_not_at_all_answers_the_other_kind_with_an_error(
        queue, thread_worker, embeddings, refused, why):
    served = {"task": "embed"} if embeddings == "only" else {}
    with thread_worker(engine=simulated(), embeddings=embeddings):
        ok = queue.submit(prompt_token_ids=[1, 2, 3], max_tokens=2, **served)
        bad = queue.submit(prompt_token_ids=[1, 2, 3], max_tokens=2, **refused)
        finals = {f.job_id: f for f in queue.wait_finals(2)}
    assert finals[ok].status == "done"
    assert finals[bad].status == "error" and finals[bad].error.startswith("rejected:") and why in finals[bad].error
