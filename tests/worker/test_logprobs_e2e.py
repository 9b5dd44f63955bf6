"""Logprobs and OpenAI penalties end to end: the SDK submits, `kvgate worker` (bundled SmolLM2-135M, CPU, in a
subprocess) generates, and the logprobs that come back are HF transformers' for the same tokens."""
from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch

from kvgate import Client
from tests.support import spawn_worker

PROMPT = "The capital of France is"
REPETITIVE = "Repeat the word dog forever: dog dog dog dog"


@pytest.fixture(scope="module")
def fleet(shared_redis):
    ns = f"lp{os.getpid()}"
    proc = spawn_worker(shared_redis.url, ns, "--model", "smollm2-135m", "--max-model-len", "256",
                        "--max-num-seqs", "4", worker_id="lp-worker")
    client = Client(shared_redis.url, namespace=ns)
    yield client
    client.close()
    proc.terminate()
    try:
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    from kvgate.engine.loader import resolve_model
    source = resolve_model("smollm2-135m")
    return source.tokenizer, AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()


def test_greedy_logprobs_are_hf_transformers_logprobs_of_the_chosen_tokens(fleet, hf):
    tokenizer, model = hf
    result = fleet.submit(PROMPT, max_tokens=10, temperature=0, logprobs=3).result(timeout=240)
    assert result.status == "done", result
    lps = result.logprobs
    assert [t.id for t in lps] == result.token_ids and len(lps) == result.usage.completion_tokens == 10
    prompt_ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + result.token_ids])).logits[0].float()
    expected = logits[len(prompt_ids) - 1:-1].log_softmax(-1)
    for pos, t in enumerate(lps):
        assert len(t.top) == 3 and [a.logprob for a in t.top] == sorted((a.logprob for a in t.top), reverse=True)
        # greedy: the chosen token is the most likely one, so it heads its alternatives
        assert t.top[0].id == t.id and t.top[0].logprob == t.logprob == max(a.logprob for a in t.top)
        assert t.logprob == pytest.approx(expected[pos, t.id].item(), abs=2e-3), pos
        assert sum(math.exp(a.logprob) for a in t.top) <= 1 + 1e-5
    # the sequence's logprob is the sum of its tokens', as HF scores the whole continuation
    assert sum(t.logprob for t in lps) == pytest.approx(
        sum(expected[pos, tok].item() for pos, tok in enumerate(result.token_ids)), abs=1e-2)
    assert b"".join(t.utf8 for t in lps).decode() == result.text
    assert "".join(t.text for t in lps) == result.text  # no token here ends mid-character


def test_streamed_deltas_carry_the_logprobs_of_their_tokens(fleet):
    handle = fleet.submit(messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0,
                          logprobs=1, stream=True)
    deltas = list(handle.stream(timeout=240))
    result = handle.result(timeout=10)
    streamed = [t for d in deltas for t in d.logprobs or []]
    assert streamed == result.logprobs and [t.id for t in streamed] == result.token_ids
    # a chat answer ends with <|im_end|>, shown by name in its logprobs and left out of the text
    assert b"".join(t.utf8 for t in streamed if t.text != "<|im_end|>").decode() == result.text


def test_a_job_without_logprobs_gets_none(fleet):
    result = fleet.submit(PROMPT, max_tokens=3, temperature=0).result(timeout=240)
    assert result.status == "done" and result.logprobs is None


def test_a_frequency_penalty_breaks_a_greedy_repetition(fleet):
    plain = fleet.submit(REPETITIVE, max_tokens=16, temperature=0, ignore_eos=True)
    penalized = fleet.submit(REPETITIVE, max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=2.0)
    presence = fleet.submit(REPETITIVE, max_tokens=16, temperature=0, ignore_eos=True, presence_penalty=2.0)
    plain, penalized, presence = (h.result(timeout=240) for h in (plain, penalized, presence))
    assert all(r.status == "done" for r in (plain, penalized, presence))
    most_repeated = Counter(plain.token_ids).most_common(1)[0][1]
    assert most_repeated >= 12, plain.text  # without a penalty the model keeps saying dog
    assert penalized.token_ids != plain.token_ids and presence.token_ids != plain.token_ids
    assert Counter(penalized.token_ids).most_common(1)[0][1] < most_repeated
