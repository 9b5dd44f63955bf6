"""Fill-in-the-middle formats (engine/fim.py): found from a tokenizer's own tokens, rendered prefix-suffix-middle."""
from __future__ import annotations

import pytest

from kvgate.engine.fim import FIM_FAMILIES, FimFormat, fim_format


@pytest.fixture(scope="module")
def smollm2_folder():
    from kvgate.engine.loader import resolve_model
    try:
        return resolve_model("smollm2-135m").path
    except Exception as e:  # the bundled model package is optional
        pytest.skip(f"bundled SmolLM2 tokenizer unavailable: {e}")


def smollm2_tokenizer(folder, *added: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if added:
        tokenizer.add_special_tokens({"additional_special_tokens": list(added)})
    return tokenizer


@pytest.mark.parametrize("family", list(FIM_FAMILIES))
def test_a_tokenizer_holding_a_familys_three_tokens_has_that_familys_format(smollm2_folder, family):
    tokens = FIM_FAMILIES[family]
    tokenizer = smollm2_tokenizer(smollm2_folder, *tokens)
    fim = fim_format(tokenizer)
    assert fim is not None and fim.family == family
    assert [fim.prefix_id, fim.suffix_id, fim.middle_id] == tokenizer.convert_tokens_to_ids(list(tokens))
    assert fim.leading_ids == ()  # SmolLM2's tokenizer adds no BOS


def test_smollm2_has_no_fill_in_the_middle_tokens(smollm2_folder):
    assert fim_format(smollm2_tokenizer(smollm2_folder)) is None


def test_two_of_a_familys_three_tokens_are_no_format(smollm2_folder):
    prefix, suffix, _ = FIM_FAMILIES["starcoder"]
    assert fim_format(smollm2_tokenizer(smollm2_folder, prefix, suffix)) is None


def test_a_fim_prompt_is_leading_ids_prefix_prompt_suffix_suffix_text_middle():
    fim = FimFormat("starcoder", prefix_id=7, suffix_id=8, middle_id=9, leading_ids=(1,))
    assert fim.render([20, 21], [30]) == [1, 7, 20, 21, 8, 30, 9]
    assert fim.render([20], []) == [1, 7, 20, 8, 9]  # an empty suffix: completing at the end


def test_the_simulated_engine_has_no_fill_in_the_middle():
    from kvgate.engine.outputs import RequestRejected
    from kvgate.engine.simulated import SimulatedEngine

    engine = SimulatedEngine(num_blocks=16, block_size=16, max_num_seqs=2, sleep=False)
    assert engine.fim is None
    with pytest.raises(RequestRejected, match="suffix: model .* has no fill-in-the-middle tokens"):
        engine.encode_fim("def f(", ") return 1")
