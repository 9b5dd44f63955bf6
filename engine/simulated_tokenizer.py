"""The simulated engine's tokenizer: ids with real text, so a structured-output job runs on the simulated fleet.

Its vocabulary, made in code: ids [0, words) are the cost model's word tokens, id i the text " t<i>" (what every
simulated answer has always read as); then the 256 bytes (id words + b is byte b), so any text a grammar asks for has
tokens; then the " t" every word token is merged from, and an end-of-text token for a grammar's end. A prompt's ids
stay the cost model's: one per whitespace-separated word, a hash of it, so prompt lengths and prefix-cache hits in the
fleet benchmarks do not change.

Where transformers is installed (kvgate[worker]) the engine gets `FastSimulatedTokenizer`
(engine/simulated_fast_tokenizer.py): a real fast tokenizer over this vocabulary, which the grammar engine reads as it
reads a model's. The torch-free install (kvgate[gateway], whose tests run simulated workers too) gets its plain twin
here, which decodes the same ids to the same text; a structured job there fails naming the missing package."""
from __future__ import annotations

import functools
import logging
import zlib

log = logging.getLogger("kvgate.engine")
EOS = "<|end|>"
CHAT_TEMPLATE = "<role> content ... <assistant>"  # rendered by apply_chat_template below, not by Jinja


def eos_id(words: int) -> int:
    return words + 257  # after the words, the 256 bytes and " t"


class WordPrompts:
    """What both tokenizers share: the cost model's prompt ids and chat rendering."""

    words: int

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        return [zlib.crc32(word.encode()) % self.words for word in text.split()]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: list | None = None,
                            **template_kwargs) -> str:  # renders no tools
        turns = " ".join(f"<{m['role']}> {m['content']}" for m in messages)
        return f"{turns} <assistant>" if add_generation_prompt else turns


class SimulatedTokenizer(WordPrompts):
    """The plain twin: the vocabulary's text for each id, without the `tokenizers` package."""

    chat_template = CHAT_TEMPLATE

    def __init__(self, vocab_size: int) -> None:
        self.words = vocab_size
        self.eos_token_id = eos_id(vocab_size)

    def __len__(self) -> int:
        return self.eos_token_id + 1

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        kept = [i for i in ids if i != self.eos_token_id] if skip_special_tokens else ids
        return b"".join(map(self._bytes, kept)).decode("utf-8", errors="replace")

    def _bytes(self, i: int) -> bytes:
        if i < self.words:
            return b" t%d" % i
        if i < self.words + 256:
            return bytes([i - self.words])
        return b" t" if i < self.eos_token_id else EOS.encode()

    def get_vocab(self) -> dict[str, int]:
        return {}  # no named tokens: no fill-in-the-middle (engine/fim.py)


@functools.cache
def simulated_tokenizer(words: int) -> WordPrompts:
    """The tokenizer of a simulated engine with `words` word tokens: one per size for every engine of a process
    (building the fast one takes 0.2-0.4 s for 32,000 words, and nothing changes it once built)."""
    try:
        from kvgate.engine.simulated_fast_tokenizer import FastSimulatedTokenizer
    except ImportError as e:
        log.info("the simulated engine's tokenizer is its plain twin (%s): structured output needs kvgate[worker]", e)
        return SimulatedTokenizer(words)
    return FastSimulatedTokenizer(words)
