"""Compiled kernels on a CUDA GPU in bf16 and fp16 across model-sized shapes.

A 16-bit kernel passes when its error against a float32 computation of the same inputs is within
twice the error of the 16-bit reference twin (plus a floor of a few ulps): the kernel must be as
accurate as the torch path the engine would otherwise run, whatever the rounding order.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.kernel_testing import context_lens_tensor, cu_seqlens, make_paged_kv
from kvgate.kernels import ops, reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
FLOOR = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-4}
HEADS = [(14, 2, 64), (16, 8, 128), (32, 8, 64), (8, 8, 128)]  # qwen2.5-0.5b, qwen3-0.6b, llama-3.2-1b, MHA


def assert_as_accurate_as_reference(out: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor) -> None:
    kernel_err = (out.float() - truth.float()).abs().max().item()
    ref_err = (ref.float() - truth.float()).abs().max().item()
    assert kernel_err <= 2 * ref_err + FLOOR[out.dtype], f"kernel error {kernel_err:.3g} vs reference {ref_err:.3g}"


def attention_case(q_lens: list[int], context: list[int], heads: tuple[int, int, int], page_size: int,
                   dtype: torch.dtype):
    num_heads, num_kv_heads, head_dim = heads
    k_cache, v_cache, block_tables = make_paged_kv(context, num_kv_heads, head_dim, page_size, dtype, "cuda")
    q = torch.randn(sum(q_lens), num_heads, head_dim, device="cuda").to(dtype)
    return q, k_cache, v_cache, block_tables, cu_seqlens(q_lens, "cuda"), context_lens_tensor(context, "cuda"), \
        head_dim ** -0.5


def check_attention(q_lens, context, heads, page_size, dtype, **kernel_kwargs) -> None:
    from kvgate.kernels.decode_attention import decode_attention
    from kvgate.kernels.prefill_attention import prefill_attention

    q, k_cache, v_cache, *rest = attention_case(q_lens, context, heads, page_size, dtype)
    decode = len(q_lens) == q.shape[0]
    kernel = decode_attention if decode else prefill_attention
    out = kernel(q, k_cache, v_cache, *rest, **kernel_kwargs)
    ref = reference.paged_attention(q, k_cache, v_cache, *rest)
    truth = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), *rest)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        assert_as_accurate_as_reference(out, ref, truth)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("batch", [1, 7, 48])
def test_gpu_decode_attention_on_random_context_lengths(dtype, heads, page_size, batch):
    rng = random.Random(batch * page_size)
    context = [rng.randint(1, 4096) for _ in range(batch)]
    check_attention([1] * batch, context, heads, page_size, dtype)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 3, 32])
def test_gpu_decode_attention_at_page_boundaries_with_forced_splits(dtype, num_splits):
    context = [1, 15, 16, 17, 255, 256, 257, 1000]
    check_attention([1] * len(context), context, (14, 2, 64), 16, dtype, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("case", ["prompts", "cached_prefix", "chunk_with_decodes"])
def test_gpu_prefill_attention(dtype, heads, page_size, case):
    q_lens, context = {
        "prompts": ([1, 17, 128, 1000], [1, 17, 128, 1000]),
        "cached_prefix": ([100, 3, 511], [356, 259, 2000]),
        "chunk_with_decodes": ([512, 1, 1, 1], [1536, 4000, 1, 77]),
    }[case]
    check_attention(q_lens, context, heads, page_size, dtype)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
def test_gpu_store_kvcache_is_exact_and_skips_padding(dtype):
    from kvgate.kernels.store_kvcache import store_kvcache

    num_tokens, num_kv_heads, head_dim = 4096, 8, 128
    qkv = torch.randn(num_tokens, 32 + 2 * num_kv_heads, head_dim, device="cuda").to(dtype)
    key, value = qkv[:, 32:40], qkv[:, 40:]
    slots = torch.randperm(600 * 16, device="cuda")[:num_tokens]
    slots[::7] = -1
    k_cache = torch.zeros(600, 16, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    reference.store_kvcache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [896, 1024, 2048, 3584, 4096])
@pytest.mark.parametrize("num_tokens", [1, 37, 4096])
def test_gpu_rms_norm_with_and_without_residual(dtype, hidden, num_tokens):
    from kvgate.kernels.rmsnorm import rms_norm

    x, r = (torch.randn(num_tokens, hidden, device="cuda").to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    out, _ = rms_norm(x, weight, 1e-6)
    assert_as_accurate_as_reference(out, reference.rms_norm(x, weight, 1e-6)[0],
                                    reference.rms_norm(x.float(), weight.float(), 1e-6)[0])
    out, residual = rms_norm(x, weight, 1e-6, r)
    ref, ref_residual = reference.rms_norm(x, weight, 1e-6, r)
    assert torch.equal(residual, ref_residual)
    assert_as_accurate_as_reference(out, ref, reference.rms_norm(ref_residual.float(), weight.float(), 1e-6)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_tokens", [1, 513])
def test_gpu_rotary(dtype, heads, num_tokens):
    from kvgate.kernels.rotary import rotary

    num_heads, num_kv_heads, head_dim = heads
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device="cuda").to(dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    angles = torch.rand(num_tokens, head_dim // 2, device="cuda") * 1000
    cos, sin = angles.cos(), angles.sin()
    out, ref = rotary(q, k, cos, sin), reference.rotary(q, k, cos, sin)
    truth = reference.rotary(q.float(), k.float(), cos, sin)
    for i in range(2):
        assert_as_accurate_as_reference(out[i], ref[i], truth[i])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [3072, 4864, 8192])
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_gpu_silu_and_mul(dtype, inner, num_tokens):
    from kvgate.kernels.activation import silu_and_mul

    x = (3 * torch.randn(num_tokens, 2 * inner, device="cuda")).to(dtype)
    assert_as_accurate_as_reference(silu_and_mul(x), reference.silu_and_mul(x),
                                    reference.silu_and_mul(x.float()))


def test_gpu_ops_take_triton_for_cuda_tensors(monkeypatch):
    from kvgate.kernels import activation

    monkeypatch.delenv("KVGATE_KERNELS", raising=False)
    called = []
    monkeypatch.setattr(activation, "silu_and_mul", lambda x: called.append(1) or x[..., : x.shape[-1] // 2])
    ops.silu_and_mul(torch.randn(2, 8, device="cuda"))
    assert called == [1]


def test_gpu_decode_attention_replays_in_a_cuda_graph_with_new_lengths():
    """The model runner captures decode once per batch size and replays with new lengths and tables."""
    heads, page_size, batch = (14, 2, 64), 16, 8
    q, k_cache, v_cache, block_tables, cu, ctx, scale = attention_case([1] * batch, [300] * batch, heads, page_size,
                                                                       torch.bfloat16)
    out = ops.paged_attention(q, k_cache, v_cache, block_tables, cu, ctx, scale)  # warm up / compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_attention(q, k_cache, v_cache, block_tables, cu, ctx, scale)
    ctx.copy_(torch.tensor([1, 17, 299, 300, 5, 160, 256, 257], device="cuda", dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    ref = reference.paged_attention(q, k_cache, v_cache, block_tables, cu, ctx, scale)
    truth = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, cu, ctx, scale)
    assert_as_accurate_as_reference(out, ref, truth)
