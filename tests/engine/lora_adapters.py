"""PEFT adapters with random non-zero weights for the LoRA tests, saved as PEFT saves them, with their HF twins."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model, folder: Path, seed: int, r: int = 8, alpha: int = 16, targets=None, scale: float = 1.0,
                 **extra):
    """Save a LoRA of `hf_model` (left as it is) in `folder`; returns the PEFT model that serves it, in eval mode.
    Both A and B are random (PEFT's default zero B would make every adapter the base model); `scale` shrinks B."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, init_lora_weights=False,
                        **extra)
    model = get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(folder)
    return model.eval()


def hf_logprobs(model, prompt: list[int], generated: list[int]) -> list[float]:
    """The log-probability the HF model gives each generated token after the prompt and the tokens before it."""
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(generated)[:, None])[:, 0].tolist()


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
