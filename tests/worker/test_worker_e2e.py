"""End to end with the real engine: the SDK submits, `kvgate worker` (bundled SmolLM2-135M, CPU, in a
subprocess) generates, the SDK reads results and streams. One worker serves the whole module (model load ~15 s)."""
from __future__ import annotations

import os

import pytest

from tests.support import smollm2_client


@pytest.fixture(scope="module")
def fleet(shared_redis):
    with smollm2_client(shared_redis.url, f"e2e{os.getpid()}", "--max-model-len", "512", "--max-num-seqs", "8",
                        worker_id="e2e-worker") as client:
        yield client


def test_four_prompts_come_back_with_text_and_a_finish_reason(fleet):
    prompts = ["The capital of France is", "Water boils at", "List three colors:", "Once upon a time"]
    handles = [fleet.submit(p, max_tokens=12, temperature=0) for p in prompts]
    results = [h.result(timeout=240) for h in handles]
    for r in results:
        assert r.status == "done" and r.text.strip() and r.finish_reason in ("stop", "length"), r
        assert r.worker == "e2e-worker" and r.usage.completion_tokens == len(r.token_ids) > 0
    assert "Paris" in results[0].text


def test_streamed_deltas_are_in_order_and_join_to_the_result(fleet):
    handle = fleet.submit(messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0,
                          stream=True)
    deltas = list(handle.stream(timeout=120))
    result = handle.result(timeout=10)
    assert [d.index for d in deltas][: len(deltas) - 1] == list(range(len(deltas) - 1))
    assert "".join(d.text for d in deltas) == result.text and result.text.strip()


def test_cancel_mid_generation_returns_cancelled_with_partial_text(fleet):
    handle = fleet.submit("Write a long story about a dragon.", max_tokens=400, ignore_eos=True, stream=True)
    for _ in zip(range(3), handle.stream(timeout=120)):
        pass
    handle.cancel()
    result = handle.result(timeout=30)
    assert result.status == "cancelled" and result.finish_reason == "abort"
    assert 3 <= len(result.token_ids) < 400 and result.text


def test_the_same_idempotency_key_is_one_job_computed_once(fleet):
    first = fleet.submit("Two plus two is", max_tokens=6, temperature=0, idempotency_key="same-key-e2e")
    second = fleet.submit("Two plus two is", max_tokens=6, temperature=0, idempotency_key="same-key-e2e")
    assert first.job_id == second.job_id
    a, b = first.result(timeout=120), second.result(timeout=120)
    assert a == b and a.status == "done"


def test_a_prompt_too_long_for_the_model_gets_an_error_and_the_worker_keeps_serving(fleet):
    too_long = fleet.submit(prompt_token_ids=[42] * 600, max_tokens=4)
    after = fleet.submit("Hello", max_tokens=4, temperature=0)
    bad = too_long.result(timeout=120)
    assert bad.status == "error" and "max_model_len" in bad.error
    assert after.result(timeout=120).status == "done"

