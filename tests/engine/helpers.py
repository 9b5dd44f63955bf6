"""Tiny random-weight models of each architecture variant, as ModelSource-like objects, with HF twins."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch




@dataclass
class TinySource:
    name: str
    config: object
    tokenizer: object
    path: Path | None
    state_dict: dict

    def weights(self, dtype: torch.dtype):
        return ((k, v.to(dtype)) for k, v in self.state_dict.items())


COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
# one KV block of these models: K and V, 2 layers, 16 tokens, 2 kv heads, head size 16, float32
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def tiny_config(variant: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    if variant == "llama":
        return LlamaConfig(**COMMON, tie_word_embeddings=False)
    if variant == "llama3_rope":
        return LlamaConfig(**COMMON, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 32})
    if variant == "llama_tied":
        return LlamaConfig(**COMMON, tie_word_embeddings=True)
    if variant == "mistral":
        return MistralConfig(**COMMON, sliding_window=128)
    if variant == "qwen2":
        return Qwen2Config(**COMMON, tie_word_embeddings=True)
    if variant == "qwen3":
        return Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)
    raise KeyError(variant)


def tiny_hf_model(variant: str, seed: int = 0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(variant), dtype=torch.float32).eval()
    with torch.no_grad():  # HF inits biases and norms to constants; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def tiny_source(variant: str = "llama", seed: int = 0) -> tuple[TinySource, object]:
    model = tiny_hf_model(variant, seed)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return TinySource(f"tiny-{variant}", model.config, None, None, sd), model


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_source("llama")


def random_prompts(n: int, lo: int, hi: int, vocab: int = 97, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def vocab_source(tokenizer) -> TinySource:
    """A tiny random Llama over `tokenizer`'s real vocabulary, so grammars and stop strings have real tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(**(COMMON | {"vocab_size": len(tokenizer), "max_position_embeddings": 512}),
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return TinySource("tiny-smol-vocab", config, tokenizer, None,
                      {k: v.detach().clone() for k, v in model.state_dict().items()})
