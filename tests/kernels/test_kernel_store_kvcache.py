"""KV store by slot mapping against reference.store_kvcache."""
from __future__ import annotations

import torch

from tests.kernels.kernel_testing import DEVICE
from kvgate.kernels import reference
from kvgate.kernels.store_kvcache import store_kvcache


def test_store_writes_each_token_to_its_slot_and_skips_minus_one_slots():
    num_blocks, page_size, num_kv_heads, head_dim = 4, 8, 2, 16
    # key and value are views into a fused qkv projection, as the model produces them
    qkv = torch.randn(6, 4 + 2 * num_kv_heads, head_dim, device=DEVICE)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([0, 7, 8, -1, 31, 17], dtype=torch.int64, device=DEVICE)
    k_cache = torch.full((num_blocks, page_size, num_kv_heads, head_dim), 7.0, device=DEVICE)
    v_cache = k_cache.clone()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    reference.store_kvcache(key, value, k_expected, v_expected, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    assert (k_cache.view(-1, num_kv_heads, head_dim)[[1, 2, 30]] == 7.0).all()  # untouched slots


def test_store_rounds_into_a_narrower_cache_dtype():
    key, value = torch.randn(3, 1, 24, device=DEVICE), torch.randn(3, 1, 24, device=DEVICE)
    slots = torch.tensor([2, -1, 5], device=DEVICE)
    k_cache = torch.zeros(2, 4, 1, 24, dtype=torch.float16, device=DEVICE)
    v_cache, k_expected, v_expected = k_cache.clone(), k_cache.clone(), k_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    reference.store_kvcache(key, value, k_expected, v_expected, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_store_into_per_layer_views_of_one_interleaved_cache_tensor():
    # [num_blocks, layer, k/v, page, heads, dim]: a layer's k_cache is a strided view, not contiguous
    cache = torch.zeros(3, 2, 2, 4, 2, 8, device=DEVICE)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    key, value = torch.randn(3, 2, 8, device=DEVICE), torch.randn(3, 2, 8, device=DEVICE)
    slots = torch.tensor([11, -1, 4], device=DEVICE)
    store_kvcache(key, value, k_cache, v_cache, slots)
    k_expected, v_expected = torch.zeros(3, 4, 2, 8, device=DEVICE), torch.zeros(3, 4, 2, 8, device=DEVICE)
    reference.store_kvcache(key, value, k_expected, v_expected, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    assert (cache[:, 0] == 0).all()  # the other layer is untouched
