"""Fill-in-the-middle: the FIM tokens a model's tokenizer has, found once, and a prompt and suffix rendered with them.

The order is prefix-suffix-middle, as vLLM and llama.cpp render it: <prefix>{prompt}<suffix>{suffix}<middle>, and the
model writes the middle. A model is FIM-capable only when its tokenizer holds all three tokens of one known family as
single tokens: a template guessed for an unknown model would be silently wrong, so such a model has no FIM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# family -> its (prefix, suffix, middle) tokens; the first family whose three tokens the tokenizer holds wins
FIM_FAMILIES: dict[str, tuple[str, str, str]] = {
    "qwen2.5-coder": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    "codellama": ("▁<PRE>", "▁<SUF>", "▁<MID>"),
    "deepseek-coder": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
}


@dataclass(frozen=True, slots=True)
class FimFormat:
    """One model's FIM tokens as ids, and the ids its tokenizer puts before any text (BOS, where it adds one)."""

    family: str
    prefix_id: int
    suffix_id: int
    middle_id: int
    leading_ids: tuple[int, ...] = ()

    def render(self, prompt_ids: list[int], suffix_ids: list[int]) -> list[int]:
        return [*self.leading_ids, self.prefix_id, *prompt_ids, self.suffix_id, *suffix_ids, self.middle_id]


def fim_format(tokenizer: Any) -> FimFormat | None:
    """The FIM format `tokenizer` supports, or None: a family's three tokens must each be one token of its vocabulary
    (special or added tokens included)."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    for family, tokens in FIM_FAMILIES.items():
        ids = [vocab.get(t) for t in tokens]
        if all(i is not None for i in ids):
            leading = tuple(tokenizer.encode("", add_special_tokens=True))  # BOS where the tokenizer adds one
            return FimFormat(family, *ids, leading_ids=leading)
    return None


def known_formats() -> str:
    """The recognised formats, for an error that says what a FIM model's tokenizer must hold."""
    return "; ".join(f"{family}: {' '.join(tokens)}" for family, tokens in FIM_FAMILIES.items())
