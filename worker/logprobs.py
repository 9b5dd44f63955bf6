"""The engine's per-token logprobs ({token id: logprob}) in the wire form: each token with its text and bytes.

A token's bytes are its own bytes as the vocabulary spells them: a byte-level BPE token writes bytes as
printable characters ('Ġ' is a space) and can hold part of a multi-byte character, a SentencePiece token
writes a space as '▁' and a byte as '<0xE2>'. Its text is those bytes decoded, U+FFFD where it holds part
of a character, as OpenAI shows it. The bytes of a job's tokens concatenate to the bytes of its output
text (special tokens aside: the output text leaves them out, their text here is their name)."""
from __future__ import annotations

import re
import math
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Protocol, runtime_checkable

from kvgate.producer.protocol import TokenLogprob, TopLogprob


@runtime_checkable
class Vocabulary(Protocol):
    """A tokenizer that names its vocabulary entries (transformers' do); another renders a token by decoding it."""

    def convert_ids_to_tokens(self, token_id: int) -> str: ...


@runtime_checkable
class FastTokenizer(Protocol):
    """transformers' fast tokenizers: a Rust tokenizer behind them, whose decoder says how tokens spell text."""

    backend_tokenizer: Any


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


@cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's reversible map from the printable characters byte-level BPE writes back to the bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def is_byte_level(tokenizer: Any) -> bool:
    """A fast (Rust-backed) tokenizer whose decoder is byte-level (GPT-2 style): its tokens spell bytes."""
    return isinstance(tokenizer, FastTokenizer) and \
        type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel"


@dataclass(slots=True)
class TokenRenderer:
    """Renders token ids for one tokenizer (None: a model that takes token ids only; its tokens have no text)."""

    tokenizer: Any
    byte_level: bool = False
    pieces: dict[int, tuple[str, bytes]] = field(default_factory=dict)  # bounded by the vocabulary

    def __post_init__(self) -> None:
        self.byte_level = is_byte_level(self.tokenizer)

    def piece(self, token_id: int) -> tuple[str, bytes]:
        found = self.pieces.get(token_id)
        if found is None:
            found = self.pieces[token_id] = self._render(token_id)
        return found

    def _render(self, token_id: int) -> tuple[str, bytes]:
        if self.tokenizer is None:
            return "", b""
        try:
            token = self.tokenizer.convert_ids_to_tokens(token_id) if isinstance(self.tokenizer, Vocabulary) else None
            utf8 = self._bytes(token) if token else None
            if utf8 is None:
                text = self.tokenizer.decode([token_id])
                return text, text.encode()
        except Exception:  # an id past the vocabulary (a model with padded embeddings) has no text
            return "", b""
        return utf8.decode("utf-8", errors="replace"), utf8

    def _bytes(self, token: str) -> bytes | None:
        """The token's bytes from its vocabulary entry; None for a tokenizer of another kind (decode it)."""
        if self.byte_level:
            table = byte_decoder()
            return bytes(table[c] for c in token) if all(c in table for c in token) else token.encode()
        if match := BYTE_FALLBACK.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        if SENTENCEPIECE_SPACE in token:
            return token.replace(SENTENCEPIECE_SPACE, " ").encode()
        return None

    def token(self, token_id: int, logprobs: dict[int, float], top: int) -> TokenLogprob:
        """`logprobs` holds the chosen token and the top alternatives (the chosen one may be among them, so
        the top `top` are the most likely `top` entries of it)."""
        text, utf8 = self.piece(token_id)
        best = sorted(logprobs.items(), key=lambda item: -item[1])[:top] if top else []
        return TokenLogprob(token_id, text, utf8, logprobs.get(token_id, 0.0),
                            [TopLogprob(t, *self.piece(t), lp) for t, lp in best])

    def tokens(self, token_ids: list[int], logprobs: list[dict[int, float]], top: int) -> list[TokenLogprob]:
        return [self.token(t, lp, top) for t, lp in zip(token_ids, logprobs)]

    def prompt(self, token_ids: list[int], logprobs: list[dict[int, float] | None], top: int) -> list[TokenLogprob]:
        """A prompt's tokens: the first, which nothing comes before, with logprob NaN and no alternatives."""
        first = TokenLogprob(token_ids[0], *self.piece(token_ids[0]), math.nan)
        return [first, *self.tokens(token_ids[1:], [lp or {} for lp in logprobs[1:]], top)]
