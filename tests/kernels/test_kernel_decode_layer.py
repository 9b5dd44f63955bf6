"""A decode layer on the GPU's dispatch path (KVGATE_KERNELS=triton; the interpreter on a CPU): the fused q/k norm +
rotary + KV store kernel is the one chosen, the launches kvgate.bench.decode_kernels lists, and the layer's output
equal to the reference twins' (what the CPU engine runs)."""
from __future__ import annotations

import pytest
import torch

from kvgate.bench.decode_kernels import (MODEL_TYPES, bind_cache, decode_layer_kernels, decode_model_kernels,
                                         decode_step, layer_config, random_layer, recording)
from kvgate.bench.kernels import MODELS
from tests.kernels.kernel_testing import DEVICE, assert_close

HIDDEN = (64, 96)  # hidden and intermediate sizes: the head layouts are the benchmarks', the GEMMs small


def layer_of(model: str, dtype=torch.float32):
    torch.manual_seed(0)
    return random_layer(layer_config(MODEL_TYPES[model], (*MODELS[model][:3], *HIDDEN)), dtype, torch.device(DEVICE))


@pytest.mark.parametrize("model", list(MODELS))
def test_a_decode_layer_on_the_gpu_path_runs_norm_rotary_and_store_as_one_kernel(model, monkeypatch):
    monkeypatch.setenv("KVGATE_KERNELS", "triton")
    launches = decode_layer_kernels(layer_of(model))
    qkv_gemm, attention = launches.index("aten.linear"), launches.index("triton._decode_split_kernel")
    assert launches[qkv_gemm + 1:attention] == ["triton._qkv_rope_store_kernel"]
    assert not {"triton._rotary_kernel", "triton._store_kvcache_kernel"} & set(launches)
    assert launches.count("triton._rms_norm_kernel") == 2  # the layer's input and post-attention norms only
    assert not [n for n in launches if n.startswith("sync:") or n.endswith("(copy)")]
    assert len(launches) == 9  # was 10 (qwen2.5, llama) and 14 (qwen3: two copies of strided q/k views, two norms)


def test_the_recorder_counts_a_reshape_that_copies_but_not_views_or_allocations():
    qkv = torch.randn(4, 32 * 16)
    q = qkv[:, :16 * 16].view(-1, 16, 16)  # a Qwen3 q view of the fused projection: not viewable as rows
    with torch.inference_mode(), recording() as launches:  # inference mode dispatches reshape whole
        q.reshape(-1, 16)
        qkv.view(4, 32, 16).reshape(-1, 16)
        torch.empty(3)
        qkv.split([256, 256], dim=-1)
        torch.promote_types(torch.float16, torch.float32)
        (qkv + 1).sum().item()
    assert launches == ["aten.reshape(copy)", "aten.add", "aten.sum", "sync:item"]


@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen2.5-0.5b"])
def test_the_gpu_path_decode_layer_equals_the_reference_layer(model, monkeypatch):
    layer = layer_of(model)
    outputs, caches = [], []
    for kernels in ("reference", "triton"):
        monkeypatch.setenv("KVGATE_KERNELS", kernels)
        bind_cache(layer, 3 * 3)
        x, residual, cos, sin, meta = decode_step(layer, batch=3, context=37)
        meta.slot_mapping[1] = -1  # a padding row (a CUDA-graph slot with no sequence) stores nothing
        with torch.inference_mode():
            outputs.append(layer(x, residual, cos, sin, meta))
        caches.append((layer.self_attn.k_cache, layer.self_attn.v_cache))
    for got, expected in zip(outputs[1], outputs[0]):
        assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for got, expected in zip(caches[1], caches[0]):
        assert_close(got, expected)
    assert caches[1][0].abs().sum() > 0  # something was stored


def test_a_whole_decode_step_launches_each_layers_kernels_and_the_models_own_few(monkeypatch):
    from types import SimpleNamespace

    from kvgate.engine.models.llama import LlamaForCausalLM

    monkeypatch.setenv("KVGATE_KERNELS", "triton")
    config = layer_config("qwen3", (*MODELS["qwen3-0.6b"][:3], *HIDDEN))
    config = SimpleNamespace(**vars(config), vocab_size=50, num_hidden_layers=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.init_rope(64)
    with pytest.raises(ValueError, match="no KV cache bound"):
        decode_model_kernels(model)
    for layer in model.model.layers:
        bind_cache(layer, 4 * 3)
    launches = decode_model_kernels(model)
    assert launches.count("triton._qkv_rope_store_kernel") == 2
    assert launches.count("triton._rms_norm_kernel") == 2 * 2 + 1  # two per layer, the final norm
    # embedding, the cos and sin rows, the final norm, the logits (in the model's dtype, as the sampler takes them)
    assert launches[:3] == ["aten.embedding", "aten.index", "aten.index"] and len(launches) == 2 * 9 + 5


def test_a_bf16_decode_step_ends_in_the_model_dtype_logits_and_a_greedy_one_in_their_argmax(monkeypatch):
    """bf16: no step casts the [batch, vocab] logits to float32 (the sampler widens only its sampling rows); the
    eager greedy step is the logits and the sampler's argmax, the graph's the same two (engine/cuda_graphs.py)."""
    from types import SimpleNamespace

    from kvgate.engine.models.llama import LlamaForCausalLM

    monkeypatch.setenv("KVGATE_KERNELS", "triton")
    config = layer_config("qwen3", (*MODELS["qwen3-0.6b"][:3], *HIDDEN))
    config = SimpleNamespace(**vars(config), vocab_size=50, num_hidden_layers=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval().requires_grad_(False)
    model.init_rope(64)
    for layer in model.model.layers:
        bind_cache(layer, 4 * 3)
    # argmax_rows as on a GPU: torch's argmax (on the CPU bf16 goes to numpy over its bits, no torch kernel)
    monkeypatch.setattr("kvgate.engine.cuda_graphs.argmax_rows", lambda logits, out=None: logits.argmax(-1))
    plain, greedy = decode_model_kernels(model), decode_model_kernels(model, greedy=True)
    logits = torch.zeros(4, 50, dtype=torch.bfloat16)
    with torch.inference_mode(), recording() as sampled:  # the sampler's greedy argmax_rows, as on a GPU
        logits.argmax(-1)
    assert "aten.to(copy)" not in plain and sampled == ["aten.argmax"]  # the eager step: logits, then the argmax
    assert greedy == plain + sampled
