"""Greedy parity with HF transformers on the bundled SmolLM2-135M-Instruct: refills and prefix-cache hits
change nothing."""
from __future__ import annotations

import pytest
import torch

from kvgate.engine import LLM, SamplingParams

SHARED = ("You are a meticulous assistant. Answer in one short paragraph, cite no sources, and keep a friendly, "
          "plain tone. The user writes about everyday topics such as cooking, travel and small repairs. ")
PROMPTS = [  # shared-prefix prompts spread out so later ones find the first one's blocks cached
    SHARED + "How do I fix a squeaky door hinge?",
    "The capital of France is",
    "def fibonacci(n):",
    SHARED + "What should I pack for a weekend in the mountains?",
    "Once upon a time, in a land far away,",
    SHARED + "Give me a quick recipe for tomato soup.",
    "1, 2, 3, 4,",
    "Translate to German: The weather is nice today.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_expected():
    from kvgate.engine.loader import resolve_model
    from transformers import AutoModelForCausalLM
    source = resolve_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    return source, [_hf_greedy(hf, source.tokenizer.encode(p)) for p in PROMPTS]


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=hf.generation_config.eos_token_id)
    return out[0, len(ids):].tolist()


def test_greedy_matches_hf_with_refills_and_again_from_the_prefix_cache(hf_expected):
    source, expected = hf_expected
    llm = LLM("smollm2-135m", max_num_seqs=3, kv_cache_memory=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in first] == expected
    assert [o.prompt_token_ids for o in first] == [source.tokenizer.encode(p) for p in PROMPTS]
    assert llm.engine.stats.prefix_hit_tokens > 0  # the shared system prefix
    hits = llm.engine.stats.prefix_hit_tokens
    second = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in second] == expected
    assert llm.engine.stats.prefix_hit_tokens > hits and all(second[i].cached_tokens > 0 for i in (0, 3, 5))
    assert first[0].text == source.tokenizer.decode(expected[0], skip_special_tokens=True)


def test_chat_applies_the_template_and_answers():
    llm = LLM("smollm2-135m", kv_cache_memory=16 << 20)
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=8),
                   use_tqdm=False)[0]
    assert "<|im_start|>assistant" in llm.tokenizer.decode(out.prompt_token_ids)
    assert out.text.strip() and out.finish_reason in ("stop", "length")


def test_streamed_text_equals_the_decoded_ids_with_multibyte_characters():
    from kvgate.engine import LLMEngine
    engine = LLMEngine("smollm2-135m", kv_cache_memory=16 << 20)
    ids = engine.tokenizer.encode("Les crêpes à la française 🥞🍓 sont délicieuses, 日本語も")
    engine.add_request("r", ids, SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True))
    deltas, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.new_text)
            last = out
    # mid-stream no half character leaks; only a character cut off by max_tokens shows as U+FFFD at the very end
    assert all("\ufffd" not in d for d in deltas[:-1]) and "\ufffd" not in deltas[-1][:-1]
    assert "".join(deltas) == last.text == engine.tokenizer.decode(last.token_ids, skip_special_tokens=True)
