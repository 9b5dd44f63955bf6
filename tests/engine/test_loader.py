"""The loader: every kind of source yields HF-named weights, and every bad input fails with a message that says what."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from kvgate.engine import gguf_convert
from kvgate.engine.loader import ModelLoadError, ModelSource, hf_reference_model, parameter_shapes, resolve_model

TINY_LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def tiny_folder(tmp_path: Path, **save_kwargs) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA, architectures=["LlamaForCausalLM"]))
    folder = tmp_path / "tiny"
    model.save_pretrained(folder, **save_kwargs)
    return folder, model


def test_unknown_random_name_is_an_error_listing_the_known_ones():
    with pytest.raises(ModelLoadError, match=r"unknown random model 'random:gpt-5'.*random:qwen3-0.6b"):
        resolve_model("random:gpt-5")


def test_missing_path_is_an_error_naming_it(tmp_path):
    with pytest.raises(ModelLoadError, match=r"not found"):
        resolve_model(str(tmp_path / "nowhere"))


def test_a_file_that_is_not_gguf_is_an_error(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file"):
        resolve_model(str(tmp_path / "model.bin"))


def test_folder_without_config_is_an_error(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        resolve_model(str(tmp_path))


def test_broken_config_json_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ModelLoadError, match=r"not valid JSON"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture_is_an_error_listing_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*not supported.*Qwen3ForCausalLM"):
        resolve_model(str(tmp_path))


def test_folder_without_safetensors_is_an_error(tmp_path):
    LlamaConfig(**TINY_LLAMA, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("name, layers, hidden, heads, kv_heads, head_dim, vocab", [
    ("random:qwen2.5-0.5b", 24, 896, 14, 2, 64, 151936),
    ("random:qwen3-0.6b", 28, 1024, 16, 8, 128, 151936),
    ("random:llama-3.2-1b", 16, 2048, 32, 8, 64, 128256),
    ("random:smollm2-135m", 30, 576, 9, 3, 64, 49152),
])
def test_random_configs_have_the_real_models_shapes(name, layers, hidden, heads, kv_heads, head_dim, vocab):
    source = resolve_model(name)
    assert source.tokenizer is None and source.path is None
    shapes = parameter_shapes(source.config)
    assert shapes["model.embed_tokens.weight"] == (vocab, hidden)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (heads * head_dim, hidden)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (kv_heads * head_dim, hidden)
    assert sum(n.endswith("mlp.down_proj.weight") for n in shapes) == layers
    assert "lm_head.weight" not in shapes  # all four tie the embedding
    assert ("model.layers.0.self_attn.q_proj.bias" in shapes) == (name == "random:qwen2.5-0.5b")
    assert ("model.layers.0.self_attn.q_norm.weight" in shapes) == (name == "random:qwen3-0.6b")


def test_llama_3_2_random_config_keeps_llama3_rope_scaling():
    rope = resolve_model("random:llama-3.2-1b").config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0 and rope["rope_theta"] == 500000.0


def tiny_random_source(seed: int = 0) -> ModelSource:
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=16,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5, tie_word_embeddings=True)
    return ModelSource(name="tiny-qwen3", config=config, tokenizer=None, path=None, seed=seed)


def test_random_weights_are_seeded_with_unit_norms_and_initializer_std():
    first, again = dict(tiny_random_source(0).weights(torch.float32)), dict(tiny_random_source(0).weights(torch.float32))
    other = dict(tiny_random_source(1).weights(torch.float32))
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["model.layers.1.mlp.up_proj.weight"], other["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(first["model.layers.0.self_attn.k_norm.weight"], torch.ones(16))
    assert first["model.embed_tokens.weight"].std().item() == pytest.approx(0.5, rel=0.1)


def test_random_weights_cast_to_the_requested_dtype():
    assert {t.dtype for _, t in tiny_random_source().weights(torch.bfloat16)} == {torch.bfloat16}


def test_random_weights_are_made_on_the_host_whatever_default_device_is_active():
    """W-GPU's HF baseline builds its model inside `with torch.device("cuda")`; the seeded CPU generator then met
    a CUDA default device and the first GPU run's baseline died (RuntimeError: Expected a 'cuda' device type for
    generator but found 'cpu'). A meta default device shows the same thing on a CPU: the weights were meta."""
    with torch.device("meta"):
        weights = dict(tiny_random_source(0).weights(torch.float32))
    plain = dict(tiny_random_source(0).weights(torch.float32))
    assert {t.device.type for t in weights.values()} == {"cpu"}
    assert all(torch.equal(weights[n], plain[n]) for n in plain)


def test_hf_reference_model_of_a_random_source_holds_exactly_its_weights():
    source = tiny_random_source()
    model = hf_reference_model(source, torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in source.weights(torch.float32))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_sharded_safetensors_folder_streams_every_shard(tmp_path):
    folder, model = tiny_folder(tmp_path, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    source = resolve_model(str(folder))
    weights = dict(source.weights(torch.float32))
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[n], t) for n, t in model.state_dict().items())
    assert source.tokenizer is None and source.config.num_hidden_layers == 2


def test_missing_shard_is_an_error_naming_it(tmp_path):
    folder, _ = tiny_folder(tmp_path, max_shard_size="20KB")
    victim = sorted(folder.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        resolve_model(str(folder))


def test_interrupted_gguf_conversion_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", killed)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: None)
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(fake))
    assert list((tmp_path / "models").iterdir()) == []


def test_smollm2_is_converted_once_and_the_cached_folder_reused(monkeypatch):
    first = resolve_model("smollm2-135m")  # converts here only on a machine that never did

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("the cached smollm2-135m folder was not reused")

    monkeypatch.setattr(gguf_convert, "convert", no_second_conversion)
    second = resolve_model("smollm2-135m")
    assert second.path == first.path == gguf_convert.cache_root() / "smollm2-135m"
    assert second.config.architectures == ["LlamaForCausalLM"] and second.config.num_hidden_layers == 30
    names = {name for name, _ in second.weights(torch.float32)}
    assert len(names) == 272 and "model.layers.29.self_attn.k_proj.weight" in names


def test_dequantized_smollm2_answers_in_english_under_hf_greedy():
    source = resolve_model("smollm2-135m")
    model = hf_reference_model(source, torch.float32)
    tok = source.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
