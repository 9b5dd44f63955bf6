"""The simulated engine's real fast tokenizer (engine/simulated_tokenizer.py describes its vocabulary): a Hugging Face
`tokenizers` byte-level BPE made in code, no download, so the grammar engine (engine/constraints.py) builds its token
view of it as it does a model's."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvgate.engine.simulated_tokenizer import CHAT_TEMPLATE, EOS, WordPrompts, eos_id


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level vocabulary."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = dict(zip(printable, map(chr, printable))) | {b: chr(256 + n) for n, b in enumerate(others)}
    return [chars[b] for b in range(256)]


def vocabulary(words: int) -> Tokenizer:
    """The `tokenizers` tokenizer of `words` word tokens, the bytes, " t" and the end-of-text token."""
    chars = byte_chars()
    space_t = chars[ord(" ")] + "t"
    vocab = {f"{space_t}{i}": i for i in range(words)}
    vocab |= {char: words + b for b, char in enumerate(chars)}
    vocab |= {space_t: words + 256, EOS: eos_id(words)}
    # " t" + "1" -> " t1", " t1" + "2" -> " t12": a word's prefixes are smaller numbers, so all are tokens too
    merges = [(chars[ord(" ")], "t")] + [(f"{space_t}{i // 10}" if i >= 10 else space_t, str(i % 10))
                                         for i in range(words)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    return tokenizer


class FastSimulatedTokenizer(WordPrompts, PreTrainedTokenizerFast):
    """Prompts as the cost model counts them (WordPrompts); ids to text, and the grammar engine's vocabulary, through
    the real tokenizer."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(tokenizer_object=vocabulary(vocab_size), eos_token=EOS, clean_up_tokenization_spaces=False,
                         chat_template=CHAT_TEMPLATE)
        self.words = vocab_size
