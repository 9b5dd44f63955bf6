"""The knobs that need a real tokenizer and model, on the bundled SmolLM2. Prompt logprobs (completions' echo with
logprobs, lm-eval's loglikelihood): each prompt token's logprob given the tokens before it equals HF transformers'
teacher-forced log-softmax, also when the prompt is prefilled in chunks and when its prefix is in the cache (such a
request takes no prefix hit). skip_special_tokens=False keeps special tokens in the text, in the engine's own
detokenization and in the batched one the worker runs."""
from __future__ import annotations

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.detokenizer import Detokenizer

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


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", max_num_seqs=3, max_num_batched_tokens=16, kv_cache_memory=32 << 20)


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


def test_prompt_logprobs_equal_hf_teacher_forced_logprobs_in_chunks_and_with_a_cached_prefix(llm, teacher_forced):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    warm = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert warm.prompt_logprobs is None  # not asked: none kept
    hits = llm.engine.stats.prefix_hit_tokens
    results = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.stats.prefix_hit_tokens == hits  # the shared prefix is cached, and recomputed for these
    for result, (ids, logp) in zip(results, teacher_forced):
        check(result, ids, logp)
        assert len(result.token_ids) == 2


def test_prompt_logprobs_of_zero_give_only_each_prompt_tokens_own(llm, teacher_forced):
    result = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    ids, logp = teacher_forced[1]
    assert [list(lp) for lp in result.prompt_logprobs[1:]] == [[t] for t in ids[1:]]
    assert [lp[t] for lp, t in zip(result.prompt_logprobs[1:], ids[1:])] == pytest.approx(
        [logp[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=2e-3)


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(llm):
    special = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={special: 100.0})
    kept, skipped = llm.generate(["Hi", "Hi"], [SamplingParams(**forced, skip_special_tokens=False),
                                                SamplingParams(**forced)], use_tqdm=False)
    assert kept.token_ids == skipped.token_ids == [special] * 3
    assert kept.text == "<|im_start|>" * 3 and skipped.text == ""


def test_the_batched_detokenizer_keeps_special_tokens_only_for_the_requests_that_ask(llm):
    detok = Detokenizer(llm.tokenizer)
    ids = llm.tokenizer.encode("Hello<|im_end|> there")
    for rid, skip, incremental in (("keep", False, True), ("skip", True, True), ("keep-end", False, False)):
        detok.add(rid, None, incremental, skip_special_tokens=skip)
    deltas = []
    for k, token in enumerate(ids):
        deltas += detok.step([(rid, [token], k == len(ids) - 1) for rid in ("keep", "skip", "keep-end")])
    final = {d.request_id: d.output_text for d in deltas if d.finished}
    streamed = "".join(d.text for d in deltas if d.request_id == "keep")
    assert final == {"keep": "Hello<|im_end|> there", "skip": "Hello there", "keep-end": "Hello<|im_end|> there"}
    assert streamed == final["keep"] and detok.keeping == 0  # finished requests are forgotten


def test_add_generation_prompt_false_leaves_the_assistant_header_off(llm):
    chat = [{"role": "user", "content": "Hi"}]
    opened = llm.tokenizer.decode(llm.engine.encode_chat(chat))
    left = llm.tokenizer.decode(llm.engine.encode_chat(chat, add_generation_prompt=False))
    assert opened.endswith("<|im_start|>assistant\n") and not left.endswith("<|im_start|>assistant\n")
    assert opened.startswith(left)


def test_chat_template_kwargs_reach_the_template_and_a_template_failing_on_them_is_rejected(llm):
    from kvgate.engine.outputs import RequestRejected

    tokenizer, saved = llm.tokenizer, llm.tokenizer.chat_template
    tokenizer.chat_template = ("{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if strict and not shout %}{{ raise_exception('strict needs shout') }}{% endif %}")
    try:
        chat = [{"role": "user", "content": "hello"}]
        assert tokenizer.decode(llm.engine.encode_chat(chat, template_kwargs={"shout": True})) == "LOUD hello"
        assert tokenizer.decode(llm.engine.encode_chat(chat)) == "hello"
        with pytest.raises(RequestRejected, match="strict needs shout"):
            llm.engine.encode_chat(chat, template_kwargs={"strict": True})
    finally:
        tokenizer.chat_template = saved
