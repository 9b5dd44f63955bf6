"""Greedy output equals HF transformers' own implementation for every supported architecture variant, and
is independent of how the engine batches, chunks, caches or preempts."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from torch import nn

from kvgate.engine import LLM, SamplingParams
from tests.engine.helpers import BLOCK_BYTES, hf_greedy, random_prompts, tiny_source
from kvgate.kernels.cpu_linear import PackedLinear, onednn_linear_available

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
VARIANTS = ["llama", "llama3_rope", "llama_tied", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def llama_reference():
    source, hf = tiny_source("llama", seed=1)
    prompts = random_prompts(6, 2, 45, seed=1) + [[5, 6, 7] * 10 + [1], [5, 6, 7] * 10 + [2]]
    expected = [hf_greedy(hf, p, GREEDY.max_tokens, eos_token_id=[]) for p in prompts]
    return source, prompts, expected


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_match_hf_for_architecture_variant(variant):
    source, hf = tiny_source(variant, seed=2)
    prompts = random_prompts(4, 1, 60, seed=2)  # past llama3's original_max_position_embeddings=32
    llm = LLM(source, kv_cache_memory=1 << 20, max_num_seqs=4)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens, eos_token_id=[]) for p in prompts]


def test_prefill_logprobs_match_hf_logits():
    source, hf = tiny_source("qwen3", seed=3)
    prompt = random_prompts(1, 20, 20, seed=3)[0]
    out = LLM(source, kv_cache_memory=1 << 20).generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                                                        use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    top = ref.topk(5)
    assert set(out.logprobs[0]) == set(top.indices.tolist())
    for token, lp in out.logprobs[0].items():
        assert lp == pytest.approx(float(ref[token]), abs=1e-4)


@pytest.mark.parametrize("settings", [
    dict(max_num_seqs=2),  # refills as sequences finish
    dict(scheduling="static", max_num_seqs=3),
    dict(max_num_batched_tokens=7),  # every prompt prefilled in chunks
    dict(kv_cache_memory=6 * BLOCK_BYTES, max_num_seqs=8),  # 6 blocks for 8 sequences: preemption
    dict(enable_prefix_caching=False, block_size=8),
], ids=["refill", "static", "chunked", "preemption", "no_prefix_cache"])
def test_greedy_output_is_the_same_however_the_engine_schedules(llama_reference, settings):
    source, prompts, expected = llama_reference
    kwargs = dict(kv_cache_memory=1 << 20) | settings
    llm = LLM(source, **kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    if kwargs["kv_cache_memory"] == 6 * BLOCK_BYTES:
        assert llm.engine.stats.total_blocks == 6 and llm.engine.stats.preemptions > 0


def test_prefix_cache_hits_on_a_second_run_and_changes_nothing(llama_reference):
    source, prompts, expected = llama_reference
    llm = LLM(source, kv_cache_memory=1 << 20, max_num_seqs=3)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    hits_before = llm.engine.stats.prefix_hit_tokens
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.stats.prefix_hit_tokens > hits_before
    assert sum(o.cached_tokens for o in second) > 0
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == expected


@pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("variant", ["llama", "llama_tied"])
def test_the_cpu_engine_runs_every_projection_and_the_lm_head_packed(variant):
    source, hf = tiny_source(variant, seed=4)
    model = LLM(source, kv_cache_memory=1 << 20).engine.runner.model
    assert not [name for name, m in model.named_modules() if type(m) is nn.Linear]
    assert isinstance(model.lm_head, PackedLinear)  # tied too: a packed copy of the embedding
    hidden = torch.randn(3, hf.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), hf.lm_head(hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_greedy_tokens_match_hf_on_cuda_through_the_triton_kernels(variant):
    source, hf = tiny_source(variant, seed=2)
    prompts = random_prompts(4, 1, 60, seed=2)
    llm = LLM(source, device="cuda", dtype="float32", kv_cache_memory=1 << 20, max_num_seqs=3)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens, eos_token_id=[]) for p in prompts]


def test_stepping_a_cpu_engine_on_another_thread_than_its_loader_warns_once(caplog):
    source, _ = tiny_source("llama", seed=5)
    llm = LLM(source, kv_cache_memory=1 << 20)
    params = SamplingParams(temperature=0, max_tokens=3)
    with caplog.at_level(logging.WARNING, logger="kvgate.engine.model_runner"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
        assert not caplog.records  # the loading thread itself
        for _ in range(2):
            thread = threading.Thread(target=llm.generate, args=([[1, 2, 3]], params), kwargs={"use_tqdm": False})
            thread.start()
            thread.join()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "this CPU engine was loaded on one thread and is stepped on another"]
