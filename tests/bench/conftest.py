"""The benchmarks' tests: one thread for torch, and a tiny random Llama folder (HF format) they run on."""
import pytest
import torch

torch.set_num_threads(1)  # the machine is shared; tiny shapes gain nothing from more threads

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama saved as an HF folder (config.json + safetensors), made once per module."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("bench") / "tiny-llama"
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])).save_pretrained(folder)
    return str(folder)
