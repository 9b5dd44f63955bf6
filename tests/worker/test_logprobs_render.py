"""The worker's rendering of engine logprobs: token text and bytes for byte-level BPE (the bundled SmolLM2),
SentencePiece byte fallback, the simulated tokenizer, and the top alternatives' order."""
from __future__ import annotations

import pytest

from kvgate.engine.cost_model_runner import SimulatedTokenizer
from kvgate.worker.logprobs import TokenRenderer


@pytest.fixture(scope="module")
def smol_tokenizer():
    from kvgate.engine.loader import resolve_model
    return resolve_model("smollm2-135m").tokenizer


def test_byte_level_tokens_show_decoded_text_and_their_own_bytes(smol_tokenizer):
    renderer = TokenRenderer(smol_tokenizer)
    text = "Hello world, café 日本"
    ids = smol_tokenizer.encode(text)
    pieces = [renderer.piece(i) for i in ids]
    assert pieces[1] == (" world", b" world")  # 'Ġworld' in the vocabulary
    assert b"".join(utf8 for _, utf8 in pieces).decode() == text
    partial = [(t, b) for t, b in pieces if "\ufffd" in t]
    assert partial, "日 is split across byte tokens in this vocabulary"
    for _, utf8 in partial:
        with pytest.raises(UnicodeDecodeError):
            utf8.decode()


def test_special_tokens_are_shown_by_name(smol_tokenizer):
    eos = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert TokenRenderer(smol_tokenizer).piece(eos) == ("<|im_end|>", b"<|im_end|>")


class SentencePieceVocabulary:
    """The two calls the renderer makes, answering as a Llama-2 style tokenizer does."""

    vocabulary = {5: "\u2581the", 6: "<0xE6>", 7: "<0x97>", 8: "<0xA5>", 9: "</s>"}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.vocabulary[token_id]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocabulary[i] for i in ids)


def test_sentencepiece_spaces_and_byte_fallback_tokens_become_their_bytes():
    renderer = TokenRenderer(SentencePieceVocabulary())
    assert renderer.piece(5) == (" the", b" the")
    assert b"".join(renderer.piece(i)[1] for i in (6, 7, 8)).decode() == "日"
    assert renderer.piece(6)[0] == "\ufffd"
    assert renderer.piece(9) == ("</s>", b"</s>")


def test_a_tokenizer_without_a_vocabulary_decodes_each_token_and_none_gives_empty_text():
    assert TokenRenderer(SimulatedTokenizer(100)).piece(42) == (" t42", b" t42")
    assert TokenRenderer(None).piece(42) == ("", b"")


def test_top_alternatives_are_the_most_likely_first_whether_or_not_the_chosen_token_is_among_them():
    renderer = TokenRenderer(SimulatedTokenizer(100))
    # the engine's dict: chosen first, then the top N (the chosen one is not repeated when it is among them)
    among = renderer.token(3, {3: -0.5, 4: -1.5, 5: -2.5}, top=3)
    assert [a.id for a in among.top] == [3, 4, 5] and among.logprob == -0.5 and among.text == " t3"
    sampled_outside = renderer.token(9, {9: -6.0, 4: -0.2, 5: -1.0}, top=2)
    assert [a.id for a in sampled_outside.top] == [4, 5] and sampled_outside.logprob == -6.0
    assert renderer.token(9, {9: -6.0}, top=0).top == []
    # the simulated engine reports only its token, at logprob 0, whatever was asked
    assert [a.id for a in renderer.token(7, {7: 0.0}, top=5).top] == [7]
