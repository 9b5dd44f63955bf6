"""LoRA on the bundled SmolLM2-135M: two random PEFT adapters (all seven target modules; attention only, rank 4)
give HF transformers + PEFT's greedy tokens and logprobs, alone and in one batch beside the base model."""
from __future__ import annotations

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from tests.engine.lora_adapters import hf_greedy, hf_logprobs, make_adapter

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
NEW = 12
SPECS = {"all": dict(r=8, alpha=16, scale=0.3), "attn": dict(r=4, alpha=8, targets=["q_proj", "v_proj", "o_proj"])}


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from kvgate.engine.loader import resolve_model
    source = resolve_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("smollm2_loras")
    prompts = [source.tokenizer.encode(p) for p in PROMPTS]
    out = {}
    for i, (name, spec) in enumerate(SPECS.items()):
        twin = make_adapter(hf, root / name, seed=10 + i, **spec)
        greedy = [hf_greedy(twin, p, NEW) for p in prompts]
        out[name] = (str(root / name), greedy, [hf_logprobs(twin, p, g) for p, g in zip(prompts, greedy)])
        del twin
    return prompts, out, [hf_greedy(hf, p, NEW) for p in prompts]


def test_smollm2_adapters_match_hf_peft_alone_and_mixed_with_the_base(expected):
    prompts, adapters, base = expected
    llm = LLM("smollm2-135m", kv_cache_memory=32 << 20, max_num_seqs=16, max_loras=2,
              loras={name: path for name, (path, _, _) in adapters.items()})
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    names = [*adapters, None]
    outs = llm.generate([p for p in prompts for _ in names], params, use_tqdm=False,
                        lora=[n for _ in prompts for n in names])
    for i, prompt in enumerate(prompts):
        for j, name in enumerate(names):
            out = outs[i * len(names) + j]
            if name is None:
                assert out.token_ids == base[i]
                continue
            _, greedy, logprobs = adapters[name]
            assert out.token_ids == greedy[i], name
            assert [lp[t] for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(logprobs[i], abs=2e-3), name
    assert outs[0].token_ids != base[0]  # the adapter changes what the model says
