"""Prompt logprobs (completions' echo with logprobs, lm-eval's loglikelihood): each prompt token's logprob given
the tokens before it equals HF transformers' teacher-forced log-softmax on the bundled SmolLM2, also when the
prompt is prefilled in chunks and when its prefix is in the cache (such a request takes no prefix hit)."""
from __future__ import annotations

import pytest
import torch

from kvgate.engine import LLM, SamplingParams

SHARED = ("You are a meticulous assistant. Answer in one short paragraph, cite no sources, and keep a friendly, "
          "plain tone. ")
PROMPTS = [SHARED + "Question: what is the capital of France? Answer: Paris", "The quick brown fox jumps over",
           SHARED + "1, 2, 3, 4, 5"]
TOP = 3


@pytest.fixture(scope="module")
def teacher_forced():
    from transformers import AutoModelForCausalLM

    from kvgate.engine.loader import resolve_model
    source = resolve_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = source.tokenizer.encode(prompt)
        with torch.no_grad():
            logp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        out.append((ids, logp))
    return out


def check(result, ids, logp) -> None:
    assert result.prompt_token_ids == ids
    lps = result.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    for p in range(1, len(ids)):
        expected = logp[p - 1]
        assert lps[p][ids[p]] == pytest.approx(expected[ids[p]].item(), abs=2e-3), p
        top = expected.topk(TOP).indices.tolist()
        assert set(top) <= set(lps[p]) and len(set(lps[p]) - {ids[p]}) <= TOP
        for t in top:
            assert lps[p][t] == pytest.approx(expected[t].item(), abs=2e-3)


def test_prompt_logprobs_equal_hf_teacher_forced_logprobs_in_chunks_and_with_a_cached_prefix(teacher_forced):
    llm = LLM("smollm2-135m", max_num_seqs=3, max_num_batched_tokens=16, kv_cache_memory=32 << 20)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    warm = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert warm.prompt_logprobs is None  # not asked: none kept
    hits = llm.engine.stats.prefix_hit_tokens
    results = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.stats.prefix_hit_tokens == hits  # the shared prefix is cached, and recomputed for these
    for result, (ids, logp) in zip(results, teacher_forced):
        check(result, ids, logp)
        assert len(result.token_ids) == 2


def test_prompt_logprobs_of_zero_give_only_each_prompt_tokens_own(teacher_forced):
    llm = LLM("smollm2-135m", kv_cache_memory=16 << 20)
    result = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    ids, logp = teacher_forced[1]
    assert [list(lp) for lp in result.prompt_logprobs[1:]] == [[t] for t in ids[1:]]
    assert [lp[t] for lp, t in zip(result.prompt_logprobs[1:], ids[1:])] == pytest.approx(
        [logp[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=2e-3)
