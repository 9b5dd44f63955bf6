"""kvgate.kernels.ops: which implementation runs, and that the forced-Triton path equals the reference path."""
from __future__ import annotations

import pytest
import torch

from kvgate.kernels import decode_attention, ops, prefill_attention, reference
from tests.kernels.kernel_testing import DEVICE, HAS_CUDA, assert_close, context_lens_tensor, cu_seqlens, make_paged_kv


def spy(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def attention_batch(q_lens: list[int], context: list[int]):
    k_cache, v_cache, block_tables = make_paged_kv(context, 2, 16, 8, device=DEVICE)
    q = torch.randn(sum(q_lens), 4, 16, device=DEVICE)
    return q, k_cache, v_cache, block_tables, cu_seqlens(q_lens, DEVICE), context_lens_tensor(context, DEVICE), 0.25


@pytest.mark.skipif(HAS_CUDA, reason="CPU-tensor default only testable without CUDA tensors in play")
def test_cpu_tensors_take_the_reference_unless_triton_is_forced(monkeypatch):
    monkeypatch.delenv("KVGATE_KERNELS", raising=False)
    calls = spy(monkeypatch, reference, "silu_and_mul")
    ops.silu_and_mul(torch.randn(2, 8))
    assert calls == [1]


def test_reference_can_be_forced(monkeypatch):
    monkeypatch.setenv("KVGATE_KERNELS", "reference")
    calls = spy(monkeypatch, reference, "paged_attention")
    ops.paged_attention(*attention_batch([1, 1], [5, 9]))
    assert calls == [1]


def test_one_query_per_sequence_takes_the_decode_kernel(monkeypatch):
    monkeypatch.setenv("KVGATE_KERNELS", "triton")
    decode = spy(monkeypatch, decode_attention, "decode_attention")
    prefill = spy(monkeypatch, prefill_attention, "prefill_attention")
    batch = attention_batch([1, 1, 1], [5, 9, 30])
    assert_close(ops.paged_attention(*batch), reference.paged_attention(*batch))
    assert (decode, prefill) == ([1], [])


def test_a_batch_with_any_multi_token_sequence_takes_the_prefill_kernel(monkeypatch):
    monkeypatch.setenv("KVGATE_KERNELS", "triton")
    decode = spy(monkeypatch, decode_attention, "decode_attention")
    prefill = spy(monkeypatch, prefill_attention, "prefill_attention")
    batch = attention_batch([1, 6, 1], [5, 9, 30])
    assert_close(ops.paged_attention(*batch), reference.paged_attention(*batch))
    assert (decode, prefill) == ([], [1])


def test_forced_triton_layer_step_equals_the_reference_step(monkeypatch):
    """store -> attention -> norm -> rotary -> activation through ops, as one model layer would call them."""
    monkeypatch.setenv("KVGATE_KERNELS", "triton")
    q_lens, context = [3, 1], [3, 6]
    k_cache, v_cache, block_tables = make_paged_kv(context, 2, 16, 4, device=DEVICE)
    slots = torch.cat([block_tables[i, (torch.arange(c - n, c) // 4)].long() * 4 + torch.arange(c - n, c) % 4
                       for i, (n, c) in enumerate(zip(q_lens, context))]).to(DEVICE)
    key, value, q = (torch.randn(4, 2, 16, device=DEVICE), torch.randn(4, 2, 16, device=DEVICE),
                     torch.randn(4, 4, 16, device=DEVICE))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ops.store_kvcache(key, value, k_cache, v_cache, slots)
    reference.store_kvcache(key, value, k_ref, v_ref, slots)
    args = (block_tables, cu_seqlens(q_lens, DEVICE), context_lens_tensor(context, DEVICE), 0.25)
    assert_close(ops.paged_attention(q, k_cache, v_cache, *args), reference.paged_attention(q, k_ref, v_ref, *args))
    x, w = torch.randn(4, 32, device=DEVICE), torch.randn(32, device=DEVICE)
    assert_close(ops.rms_norm(x, w, 1e-6, x)[0], reference.rms_norm(x, w, 1e-6, x)[0])
    cos, sin = torch.rand(4, 8, device=DEVICE), torch.rand(4, 8, device=DEVICE)
    assert_close(ops.rotary(q, key, cos, sin)[1], reference.rotary(q, key, cos, sin)[1])
    assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x))
