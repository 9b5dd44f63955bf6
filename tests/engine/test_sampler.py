"""Sampling: seeded reproducibility, the support top-k/top-p leave, HF's repetition penalty, logprobs."""
from __future__ import annotations

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.sampler import apply_repetition_penalty, apply_top_k_top_p
from tests.engine.helpers import random_prompts, tiny_source


@pytest.fixture(scope="module")
def llm():
    source, _ = tiny_source("llama", seed=4)
    return LLM(source, kv_cache_memory=1 << 20)


PROMPTS = random_prompts(3, 4, 12, seed=4)


def test_fixed_seed_reproduces_the_same_samples_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].token_ids
    batched = llm.generate(PROMPTS, [params, SamplingParams(temperature=1.0, max_tokens=5, seed=1), params],
                           use_tqdm=False)
    assert batched[0].token_ids == alone
    assert batched[2].token_ids == llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].token_ids


def test_different_seeds_give_different_samples(llm):
    outs = [llm.generate([PROMPTS[0]], SamplingParams(temperature=1.5, max_tokens=16, seed=s, ignore_eos=True),
                         use_tqdm=False)[0].token_ids for s in (1, 2)]
    assert outs[0] != outs[1]


def test_top_k_keeps_only_the_k_most_likely_tokens():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    kept = torch.isfinite(apply_top_k_top_p(logits, 2, 1.0)).nonzero().flatten().tolist()
    assert kept == [1, 3]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    kept = torch.isfinite(apply_top_k_top_p(logits, -1, 0.7)).nonzero().flatten().tolist()
    assert kept == [0, 1]
    assert torch.isfinite(apply_top_k_top_p(logits, -1, 0.01)).sum() == 1  # the top token always survives


def test_sampled_tokens_stay_inside_the_top_k_support(llm):
    source, hf = tiny_source("llama", seed=4)
    prompt = PROMPTS[1]
    with torch.no_grad():
        allowed = set(hf(torch.tensor([prompt])).logits[0, -1].topk(3).indices.tolist())
    firsts = {llm.generate([prompt], SamplingParams(temperature=2.0, top_k=3, max_tokens=1, seed=s),
                           use_tqdm=False)[0].token_ids[0] for s in range(12)}
    assert firsts <= allowed and len(firsts) > 1


def test_repetition_penalty_matches_hf_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    logits = torch.randn(1, 20)
    ids = [3, 5, 5, 7]
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([ids]), logits.clone())
    ours = logits[0].clone()
    apply_repetition_penalty(ours, ids, 1.3)
    assert torch.allclose(ours, expected[0])


def test_greedy_with_repetition_penalty_matches_hf_generate():
    source, hf = tiny_source("llama", seed=5)
    prompt = random_prompts(1, 6, 6, seed=5)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, repetition_penalty=1.5,
                          eos_token_id=[], pad_token_id=0)[0, len(prompt):].tolist()
    out = LLM(source, kv_cache_memory=1 << 20).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.5, ignore_eos=True),
        use_tqdm=False)[0]
    assert out.token_ids == ref


def test_logprobs_hold_the_chosen_token_and_top_alternatives(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) == 3 and lp[token] == max(lp.values())


@pytest.mark.parametrize("kwargs, word", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=0), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(stop=[""]), "stop"), (dict(seed=-3), "seed"), (dict(logprobs=50), "logprobs"),
])
def test_invalid_sampling_params_raise_naming_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)
